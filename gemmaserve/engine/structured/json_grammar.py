"""JSON grammars: xgrammar converts the schema; its whitespace and numbers are then bounded.

Left to xgrammar's defaults a JSON grammar lets a model pad (`{\\n  \\n  \\n ...`, up to the whitespace
limit at every gap) and write numbers of any length (a base model writes `100000...` until
max_tokens). Two changes, both through the grammar library rather than on the output:

- whitespace: xgrammar is asked for at most one whitespace character per gap (each gap becomes its
  own rule), and each such rule is then redefined as what pretty-printing needs: nothing, one space,
  or one newline and an indent. Compact JSON, `json.dumps` defaults and `json.dumps(indent=2/4)`
  fit; blank lines and runs of spaces do not.
- numbers, as I-JSON (RFC 7493) has them: an integer the schema leaves unbounded on a side gets the
  bound +-(2**53 - 1) there (the schema keyword, so xgrammar writes the exact range; a bound the
  schema gives is kept), a number bounded on one side only gets the same on the other (xgrammar's
  ranges of numbers have at most 6 fraction digits and no exponent); any number the schema leaves
  open (and every number of `json_object`) is xgrammar's `basic_number`, redefined with at most 16
  integer digits, 17 fraction digits (a double's shortest repr) and a 3-digit exponent (doubles
  end near 1.8e308).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

I_JSON_MAX = 2**53 - 1   # the largest integer every I-JSON reader holds exactly (RFC 7493, 2.2)

# Keywords whose value is one subschema, a list of them, or a map of names to them (JSON Schema
# drafts 4 to 2020-12). Only these are walked: `const`, `enum`, `default` and `examples` are values.
_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# What xgrammar writes for a gap of at most one whitespace character (max_whitespace_cnt=1).
_XGRAMMAR_GAP = '("" | ([ \\n\\r\\t]))'


@dataclass(frozen=True)
class JsonLimits:
    """How much room a JSON document has between and inside its tokens."""

    max_indent: int = 32          # spaces or tabs after a newline: 8 levels of 4, 16 of 2
    integer_digits: int = 16      # 2**53 - 1 has 16
    fraction_digits: int = 17
    exponent_digits: int = 3

    def gap(self) -> str:
        return f'("" | " " | "\\n" [ \\t]{{0,{self.max_indent}}})'

    def integer(self) -> str:
        return f'("0" | "-"? [1-9] [0-9]{{0,{self.integer_digits - 1}}})'

    def number(self) -> str:
        return (f'("-"? ("0" | [1-9] [0-9]{{0,{self.integer_digits - 1}}}) ("." [0-9]{{1,{self.fraction_digits}}})? '
                f'([eE] [+\\-]? [0-9]{{1,{self.exponent_digits}}})?)')


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bound(schema: dict) -> dict:
    """`schema` with I-JSON bounds where it leaves an integer or number open (see the module)."""
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    integer, number = "integer" in types, "number" in types
    if not (integer or number):
        return schema
    low = next((schema[k] for k in ("minimum", "exclusiveMinimum") if _is_number(schema.get(k))), None)
    high = next((schema[k] for k in ("maximum", "exclusiveMaximum") if _is_number(schema.get(k))), None)
    if number and not integer and low is None and high is None:
        return schema   # basic_number, bounded in the grammar (an exact range would drop exponents)
    out = dict(schema)
    if low is None and (high is None or high >= -I_JSON_MAX):
        out["minimum"] = -I_JSON_MAX
    if high is None and (low is None or low <= I_JSON_MAX):
        out["maximum"] = I_JSON_MAX
    return out


def bound_numbers(schema: Any) -> Any:
    """A copy of `schema` with every integer and half-bounded number given I-JSON bounds."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = bound_numbers(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [bound_numbers(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: bound_numbers(s) for name, s in out[key].items()}
    return _bound(out)


def json_ebnf(xgrammar: Any, schema: str, strict: bool, limits: JsonLimits = JsonLimits()) -> str:
    """The EBNF grammar of documents valid against `schema` (JSON text), bounded as the module says.
    Raises json.JSONDecodeError for bad JSON and xgrammar's errors for a schema it cannot convert."""
    bounded = json.dumps(bound_numbers(json.loads(schema)))
    grammar = xgrammar.Grammar.from_json_schema(bounded, any_whitespace=True, max_whitespace_cnt=1,
                                                strict_mode=strict)
    rules = {"basic_integer": limits.integer(), "basic_number": limits.number()}
    lines = []
    for line in str(grammar).splitlines():
        name, sep, body = line.partition(" ::= ")
        if sep and body == _XGRAMMAR_GAP:
            line = f"{name} ::= {limits.gap()}"
        elif sep and name in rules:
            line = f"{name} ::= {rules[name]}"
        lines.append(line)
    return "\n".join(lines) + "\n"
