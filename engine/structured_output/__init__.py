"""Structured output: decoding constrained to a JSON schema, a regex, a list of choices or a grammar.

`spec` turns request fields into one canonical constraint (and checks it compiles, without a
tokenizer); `grammar_compiler` compiles it for the model's vocabulary (cached); `guided_sequences`
keeps one matcher per constrained sequence and fills the batch's token bitmask each step.
The grammar engine is xgrammar (bench/grammar_engines.py measures why).
"""
