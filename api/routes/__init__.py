"""One APIRouter per noun: jobs, openai (chat + completions), models, health."""
