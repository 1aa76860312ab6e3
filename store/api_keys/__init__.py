"""The API-key aggregate: the form of a key and its stored hash (key_secrets), and the api_keys rows
(key_queries: create, list, revoke, look up). Who a key lets in is the API's decision (api/auth.py)."""
