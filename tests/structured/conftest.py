"""A tiny random model whose chat template renders tools (Hermes / Qwen2.5 style), served
in-process; the engine speculates (n-gram) or not."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.server.conftest import TINY_ENGINE, ServerThread

# What Qwen2.5's template does with tools, in brief: list the signatures in a system turn and
# ask for <tool_call>{"name": ..., "arguments": ...}</tool_call>; earlier calls are written back
# the same way, tool results as "tool" turns.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call one or more functions:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Reply with <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call>.<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>"
    "{{ {\"name\": c.function.name, \"arguments\": c.function.arguments} | tojson }}"
    "</tool_call>{%- endfor %}{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="package")
def tools_model_path(tiny_model_factory, tmp_path_factory) -> str:
    src, _ = tiny_model_factory("llama")
    dst = tmp_path_factory.mktemp("tiny_tools")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    config_path = os.path.join(dst, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    with open(os.path.join(dst, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(TOOLS_TEMPLATE)
    return str(dst)


@pytest.fixture(scope="package")
def server(tools_model_path):
    s = ServerThread(tools_model_path, engine_kwargs=TINY_ENGINE)
    yield s
    s.stop()


@pytest.fixture(scope="package")
def spec_server(tools_model_path):
    s = ServerThread(tools_model_path, engine_kwargs={**TINY_ENGINE,
                                                      "speculative_method": "ngram",
                                                      "num_speculative_tokens": 3})

    def keep_proposing(engine):
        engine.spec.min_acceptance = 0.0      # never pause a request for low acceptance
        engine.spec.max_verify_rows = None    # and propose whatever the CPU's row tile
    s.in_engine(keep_proposing)
    yield s
    s.stop()


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture
def client(server):
    return openai_client(server)
