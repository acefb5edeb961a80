#!/usr/bin/env python3
"""Regenerates tests/fixtures/tokenize_golden.json: what HF transformers renders and encodes for
a few chat requests, the reference `src/tokenize` is tested against (tokenize::tests::
matches_transformers_goldens).

    cargo test --lib tokenize::tests::write_golden_folder -- --ignored   # -> /tmp/radixgate-golden
    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install transformers jinja2
    /tmp/hf/bin/python scripts/tokenize-golden.py /tmp/radixgate-golden

Each case is a request body (as the gateway receives it) and the messages / tools SGLang's
serving_chat hands to apply_chat_template after normalising them (null fields dropped, content
parts joined, tool-call arguments parsed, a final assistant message turned into a user one,
tools in pydantic's dump shape).
"""
import json
import sys

import transformers
from transformers import AutoTokenizer

tools_req = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city ü"}}, "required": ["city"]}}}]
# SGLang 0.5.23's dump of that tool: the function's keys in the client's order, no `strict`
# unless sent (tests/tokenizer_golden.rs checks this shape against SGLang's own models).
tools_dump = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city ü"}}, "required": ["city"]}}, "defer_loading": None}]
cases = []
m1 = [{"role": "system", "content": "  You are helpful.\n"}, {"role": "user", "content": "What's the weather in Paris?  "}]
cases.append({"body": {"messages": m1, "tools": tools_req, "chat_template_kwargs": {"extra_flag": True}}, "py_messages": m1, "py_tools": tools_dump, "py_kwargs": {"extra_flag": True}})
m2_req = m1 + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": 1.5}"}}]}, {"role": "tool", "content": "  sunny and 21 degrees \u001c", "tool_call_id": "c1"}, {"role": "user", "content": "thanks <|eot_id|> bye"}]
m2_py = m1 + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "index": None, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": 1.5}}}]}, {"role": "tool", "content": "  sunny and 21 degrees \u001c", "tool_call_id": "c1"}, {"role": "user", "content": "thanks <|eot_id|> bye"}]
cases.append({"body": {"messages": m2_req, "tools": tools_req, "chat_template_kwargs": {"extra_flag": 0}}, "py_messages": m2_py, "py_tools": tools_dump, "py_kwargs": {"extra_flag": 0}})
m3 = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two\n"}]}]
cases.append({"body": {"messages": m3}, "py_messages": [{"role": "user", "content": "part one part two\n"}], "py_tools": None, "py_kwargs": {}})
m4 = [{"role": "user", "content": "unicode: 日本語 🎉 naïve\u00a0\u2003x  "}, {"role": "assistant", "content": "sure"}]
cases.append({"body": {"messages": m4}, "py_messages": [m4[0], {"role": "user", "content": "sure"}], "py_tools": None, "py_kwargs": {}})

model = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model)
out = {"template": open(f"{model}/chat_template.jinja").read(), "cases": []}
for c in cases:
    text = tok.apply_chat_template(c["py_messages"], tools=c["py_tools"], add_generation_prompt=True,
                                   tokenize=False, **c["py_kwargs"])
    out["cases"].append({"body": json.dumps(c["body"]), "text": text,
                         "ids": tok.encode(text, add_special_tokens=False)})
out["prompt"] = "Hello there, plain prompt <|eot_id|>!"
out["prompt_ids"] = tok.encode(out["prompt"])
out["produced_by"] = (f"transformers {transformers.__version__} apply_chat_template(tokenize=False) + "
                      "encode(add_special_tokens=False), messages as SGLang normalizes them")
json.dump(out, open("tests/fixtures/tokenize_golden.json", "w"), ensure_ascii=False, indent=1)
