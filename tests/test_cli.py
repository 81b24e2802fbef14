"""The CLI streams a generation and reports model facts."""
from __future__ import annotations

from kvforge import LLM, SamplingParams
from kvforge.cli import main


def test_generate_streams_same_text_as_api(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama")
    rc = main(["generate", "Hello there", "--model", path, "--max-tokens", "7", "--num-kv-blocks",
               "64", "--no-chat-template"])
    assert rc == 0
    printed = capsys.readouterr().out
    expected = LLM(path, num_kv_blocks=64).generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    assert printed.rstrip("\n") == expected[0].outputs[0].text


def test_info_reports_kv_bytes_per_token(default_model_path, capsys):
    assert main(["info", default_model_path]) == 0
    out = capsys.readouterr().out
    # SmolLM2: 30 layers x (K + V) x 3 kv heads x 64 dims x 4 bytes = 46080
    assert "46080 bytes per token" in out


def test_bad_model_path_is_a_clean_error(capsys, tmp_path):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing")])
    assert rc == 2
    assert "missing" in capsys.readouterr().err
    rc = main(["generate", "x", "--model", str(tmp_path / "missing"), "--device", "gpu0"])
    assert rc == 2
    assert "'gpu0' is not a torch device" in capsys.readouterr().err


def test_chat_keeps_the_conversation_and_replies_like_the_api(tiny_model_factory, capsys,
                                                             monkeypatch):
    """Two turns typed on stdin, then an empty line: each reply is the greedy completion of the
    whole conversation so far (system message, earlier turns and replies) in the chat template."""
    import io

    from kvforge.tokenizer import Tokenizer
    path, _ = tiny_model_factory("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\nAnd then?\n\nnever read\n"))
    rc = main(["chat", "--model", path, "--system", "Be brief.", "--max-tokens", "6",
               "--num-kv-blocks", "64"])
    assert rc == 0
    printed = capsys.readouterr().out

    llm, tok = LLM(path, num_kv_blocks=64), Tokenizer.from_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "system", "content": "Be brief."}]
    expected = ""
    for user in ("Hello there", "And then?"):
        messages.append({"role": "user", "content": user})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        reply = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        expected += f"> {reply}\n"
    assert all(m["content"] for m in messages[2::2]), messages     # replies are not empty
    assert printed == expected + "> "                    # the empty line ends the chat


def test_chat_ends_at_end_of_input(tiny_model_factory, capsys, monkeypatch):
    import io
    path, _ = tiny_model_factory("llama")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", "--model", path, "--num-kv-blocks", "64"]) == 0
    assert capsys.readouterr().out == "> "


def test_generate_wraps_in_the_chat_template_only_when_the_model_has_one(tiny_model_factory,
                                                                          tmp_path, capsys):
    """Default: an instruct model's prompt is wrapped as a user turn; a base model (no template)
    takes it as typed instead of failing; --chat-template on a base model is a clear error."""
    import json
    import shutil
    path, _ = tiny_model_factory("llama")
    flags = ["--max-tokens", "5", "--num-kv-blocks", "64"]
    params = SamplingParams(temperature=0, max_tokens=5)
    llm = LLM(path, num_kv_blocks=64)
    wrapped = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert main(["generate", "Hi", "--model", path, *flags]) == 0
    expected = llm.generate([wrapped], params, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out.rstrip("\n") == expected

    base = tmp_path / "base"                      # the same model without a chat template
    shutil.copytree(path, base)
    config_path = base / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (base / "chat_template.jinja").unlink(missing_ok=True)
    (base / "chat_template.json").unlink(missing_ok=True)
    assert LLM(str(base), num_kv_blocks=64).tokenizer.chat_template is None
    assert main(["generate", "Hi", "--model", str(base), *flags]) == 0
    expected = llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out.rstrip("\n") == expected
    assert main(["generate", "Hi", "--model", str(base), "--chat-template", *flags]) == 2
    assert "--no-chat-template" in capsys.readouterr().err
    # chat refuses a base model at start, before waiting for a first prompt
    assert main(["chat", "--model", str(base), "--num-kv-blocks", "64"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "kvforge chat needs a chat model" in err
