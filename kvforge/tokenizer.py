"""Tokenizer: a thin wrapper over a fast tokenizer with the engine's vocabulary.

The engine needs ids in, text out, a chat template and the set of ids that end a generation.
transformers does the real work (BPE, added tokens, jinja2 chat templates, GGUF vocabularies);
this class only fixes the choices the engine depends on (e.g. no decode-time space clean-up, so
decoding a token list piecewise and whole agree). A GGUF model's tokenizer, once converted and
cached, is read back without importing transformers (``tokenizer_file.TokenizerFile``: the
same files through ``tokenizers`` and jinja2), which is seconds off every start.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

# Turn-end markers of common chat templates. When the template uses one and it is a single
# token, generation must stop there even if the model's eos is a different token.
_CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                    "</s>")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, *, extra_eos_token_ids: Sequence[int] = (),
                 saved_dir: str | None = None) -> None:
        # hf_tokenizer: transformers' tokenizer, or a TokenizerFile over `saved_dir`
        self._tok = hf_tokenizer
        self._saved_dir = saved_dir
        eos: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos.append(int(hf_tokenizer.eos_token_id))
        eos.extend(int(i) for i in extra_eos_token_ids)
        template = self.chat_template or ""
        for text in _CHAT_END_TOKENS:
            if text not in template:
                continue
            ids = hf_tokenizer.convert_tokens_to_ids([text])
            if ids and ids[0] is not None and ids[0] != hf_tokenizer.unk_token_id:
                eos.append(int(ids[0]))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))   # dedup, keep order

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Vocabulary, merges and chat template from a GGUF file's metadata (offline).

        transformers re-parses the whole GGUF to build the tokenizer (seconds), so the result is
        saved once under the kvforge cache dir, keyed by the file's path, size and mtime, and later
        loads read that fast tokenizer.json instead (without transformers)."""
        from kvforge.tokenizer_file import TokenizerFile, compact_tokenizer_json, is_compact
        path = os.path.abspath(path)
        cached = _gguf_tokenizer_cache_dir(path)
        saved = os.path.join(cached, "tokenizer.json") if cached is not None else None
        if saved is not None and os.path.isfile(saved):
            try:
                if not is_compact(saved):     # an entry written before the compact form
                    compact_tokenizer_json(saved)
                if not os.path.isfile(os.path.join(cached, _SOURCE_FILE)):
                    _record_source(cached, path)     # an entry from before sources were kept
                return cls(TokenizerFile(cached), saved_dir=cached)
            except Exception:  # a damaged cache entry: rebuild it below
                pass
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                           local_files_only=True)
        if cached is not None:
            try:
                tmp = f"{cached}.tmp{os.getpid()}"
                hf.save_pretrained(tmp)
                # the form later starts read fastest (tokenizer_file.compact_tokenizer_json)
                compact_tokenizer_json(os.path.join(tmp, "tokenizer.json"))
                _record_source(tmp, path)
                os.makedirs(os.path.dirname(cached), exist_ok=True)
                _prune_stale_entries(os.path.dirname(cached))
                os.replace(tmp, cached)
            except OSError:  # read-only home or a concurrent writer: the cache is optional
                pass
        return cls(hf)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "Tokenizer":
        """tokenizer.json / tokenizer_config.json from a HF model directory (offline)."""
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        return cls(hf, extra_eos_token_ids=_generation_config_eos(model_dir))

    # --- vocabulary ---------------------------------------------------------------------------
    @property
    def hf_tokenizer(self) -> Any:
        """transformers' tokenizer (loaded now if this one reads a saved tokenizer without it):
        for saving it beside a model and for reference checks."""
        if self._saved_dir is not None:
            from transformers import AutoTokenizer
            self._tok = AutoTokenizer.from_pretrained(self._saved_dir, local_files_only=True)
            self._saved_dir = None
        return self._tok

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocab + added tokens)."""
        return len(self._tok)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._tok.all_special_ids)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(ids))

    # --- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of spaces: it rewrites " ." -> "." depending on neighbours, which would
        # make decode(a + b) != decode(a) + decode(b) at the seams the detokenizer relies on.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)

    # --- chat ---------------------------------------------------------------------------------
    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the ``tools`` variable (Qwen2.5's does)."""
        return "tools" in (self.chat_template or "")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (a base model?); pass a plain "
                             "prompt instead (the server's /v1/completions, `kvforge generate "
                             "--no-chat-template`, LLM.generate)")
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        if tools and not self.renders_tools:
            raise ValueError("this model's chat template does not render tools, so the model "
                             "would never see them; use a model whose template has tools "
                             "(e.g. Qwen2.5) or leave tools out")
        return self._tok.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **({"tools": tools} if tools else {}))

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The rendered text already holds the template's special tokens (bos included when the
        # template writes it), so encoding must not add them a second time.
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools)
        return self.encode(text, add_special_tokens=False)


def _generation_config_eos(model_dir: str) -> list[int]:
    """Extra stop ids from generation_config.json (e.g. Llama-3 lists several)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


_SOURCE_FILE = "source.json"


def _source_stamp(path: str) -> dict | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _record_source(entry: str, path: str) -> None:
    """The GGUF file a cache entry was converted from, beside it (``_prune_stale_entries``)."""
    with open(os.path.join(entry, _SOURCE_FILE), "w", encoding="utf-8") as f:
        json.dump(_source_stamp(path), f)


# an entry without a recorded source (written before sources were kept; a hit records it) is
# removed once it has gone this long unmodified: it is one no load has asked for since
LEGACY_ENTRY_MAX_AGE_S = 7 * 24 * 3600


def _prune_stale_entries(root: str) -> None:
    """Remove the cache entries whose GGUF file is gone or changed (its key can never be asked
    for again): files converted once from temporary paths (test suites, downloads moved away)
    would otherwise pile up, ~0.1-35 MB each. Run when an entry is written, never on a hit.
    An entry without a recorded source goes after LEGACY_ENTRY_MAX_AGE_S (rebuilt if asked
    for again)."""
    import shutil
    import time
    for name in os.listdir(root):
        entry = os.path.join(root, name)
        try:
            with open(os.path.join(entry, _SOURCE_FILE), encoding="utf-8") as f:
                recorded = json.load(f)
        except ValueError:
            recorded = None
        except OSError:
            try:
                legacy = time.time() - os.stat(entry).st_mtime > LEGACY_ENTRY_MAX_AGE_S
            except OSError:
                continue
            if legacy and os.path.isdir(entry) and ".tmp" not in name:
                shutil.rmtree(entry, ignore_errors=True)
            continue
        if not isinstance(recorded, dict) or _source_stamp(recorded.get("path", "")) != recorded:
            shutil.rmtree(entry, ignore_errors=True)


def _gguf_tokenizer_cache_dir(path: str) -> str | None:
    """``$KVFORGE_CACHE_DIR`` (default ~/.cache/kvforge)/tokenizers/<key>; None disables caching."""
    import hashlib
    root = os.environ.get("KVFORGE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache",
                                                                "kvforge"))
    if root in ("", "0", "off"):
        return None
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(root, "tokenizers", key)
