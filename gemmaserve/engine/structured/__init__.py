"""Structured output: grammars (JSON schemas, regexes, EBNF, tool calls) compiled per request and applied as
token masks at sampling (structured_output.py; json_grammar.py writes the JSON grammars)."""
