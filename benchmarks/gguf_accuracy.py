"""What running a GGUF file in its own blocks costs in accuracy, per block type.

For each file, the native path (``--quantization gguf``: 8-bit activations times the file's
blocks) against the same file dequantized to fp32 (``--quantization none``, the reference), on
The Tempest:

- perplexity over ``--tokens`` tokens in windows of 512, each window run as forwards of 16
  tokens (the rows of a decode batch or a verification step, not one 512-token prefill), and
  its change vs the reference. Which kernel scores them is the machine's choice for 16 rows
  (docs/gguf_native.md): ``KVFORGE_GGUF_GEMM_ROWS=0`` measures the integer dot kernels that
  decode a single sequence, ``KVFORGE_GGUF_GEMM_ROWS=1 KVFORGE_GGUF_GEMM_KERNEL=panels`` the
  int8 panels of prefill chunks and large batches;
- teacher-forced top-1 agreement with HF transformers loading the same file dequantized (fp32)
  over the first ``--agree-tokens`` tokens (``--hf``; transformers needs the file's
  architecture), and with kvforge's own fp32 reference.

Files: catalogue names or paths (``--models``), plus ``--requantize TYPE ...``: the default
model re-encoded by gguf-py in the legacy types it writes (Q4_0, Q5_0, Q5_1, Q8_0, F16, BF16),
so every type the kernels take is measured on a real model (the K-quants come with the
catalogue's Q4_K_M files: Q4_K, Q6_K; Q5_K has no file here).

    .venv/bin/python benchmarks/gguf_accuracy.py                        # default + 1.5B
    .venv/bin/python benchmarks/gguf_accuracy.py --models smollm2-135m-instruct \\
        --requantize Q4_0 Q5_0 Q5_1 Q8_0 F16 BF16 --no-hf
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.hardware import hardware_line  # noqa: E402
from benchmarks.report import format_table  # noqa: E402

CHUNK = 16          # tokens per forward: DecodeStack's longest query run
WINDOW = 512


def requantized_default(qtype: str, out_dir: str) -> str:
    """The default model's GGUF with every 2-D projection re-encoded as ``qtype`` by gguf-py
    (dequantized from the file first); other tensors and all metadata as they were."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
    from gguf.constants import GGUFValueType

    from kvforge.loader.default_model import default_model_path
    src = GGUFReader(default_model_path())
    arch = str(bytes(src.fields["general.architecture"].parts[-1]), "utf-8")
    path = os.path.join(out_dir, f"smollm2-{qtype.lower()}.gguf")
    writer = GGUFWriter(path, arch)
    for name, field in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = [str(bytes(field.parts[i]), "utf-8") if sub == GGUFValueType.STRING
                      else field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, values, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            writer.add_key_value(name, str(bytes(field.parts[-1]), "utf-8"), vtype)
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], vtype)
    target = GGMLQuantizationType[qtype]
    for t in src.tensors:
        values = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if values.ndim == 2 and values.shape[-1] % 32 == 0 and "norm" not in t.name:
            writer.add_tensor(t.name, quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def block_types(path: str) -> str:
    from gguf import GGUFReader
    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors
                                 if len(t.shape) == 2)
    return "+".join(name for name, _ in counts.most_common())


@torch.inference_mode()
def chunked_logits(model, ids: list[int]) -> torch.Tensor:
    from kvforge.eval.perplexity import forward_in_chunks
    blocks = -(-len(ids) // 16)
    caches = [torch.zeros(model.kv_cache_shape(blocks, 16), dtype=model.kv_cache_dtype())
              for _ in range(model.num_layers)]
    hidden = forward_in_chunks(model, torch.tensor(ids), caches, 16, CHUNK)
    return model.compute_logits(hidden).float()


def measure(path: str, tokens: int, agree_tokens: int, use_hf: bool) -> dict:
    from kvforge.eval.corpus import shakespeare_text
    from kvforge.eval.perplexity import perplexity
    from kvforge.loader.source import load_model_source
    from kvforge.quant.loading import load_model
    source = load_model_source(path)
    ids = source.load_tokenizer().encode(shakespeare_text())
    row = {"file": os.path.basename(path), "types": block_types(path)}
    logits = {}
    for quantization in ("gguf", "none"):
        model = load_model(source, quantization=quantization)
        row[f"ppl_{quantization}"] = perplexity(model, ids, max_tokens=tokens, window=WINDOW,
                                                progress=False, chunk=CHUNK).perplexity
        logits[quantization] = chunked_logits(model, ids[:agree_tokens])
        del model
    row["ppl_change"] = row["ppl_gguf"] / row["ppl_none"] - 1
    row["agree_fp32"] = (logits["gguf"].argmax(-1) == logits["none"].argmax(-1)).float().mean()
    if use_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                  gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).eval()
        with torch.inference_mode():
            ref = hf(torch.tensor([ids[:agree_tokens]])).logits[0].float()
        row["agree_hf"] = (logits["gguf"].argmax(-1) == ref.argmax(-1)).float().mean()
        del hf
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*",
                        default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    parser.add_argument("--requantize", nargs="*", default=[],
                        choices=["Q4_0", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--agree-tokens", type=int, default=1024)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers oracle")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvforge.loader.catalog import resolve_model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [resolve_model(m) for m in args.models]
        paths += [requantized_default(q, tmp) for q in args.requantize]
        for path in paths:
            r = measure(path, args.tokens, args.agree_tokens, not args.no_hf)
            print(r, flush=True)
            rows.append([r["file"], r["types"], r["ppl_none"], r["ppl_gguf"],
                         f"{100 * r['ppl_change']:+.3f}%", f"{float(r['agree_fp32']):.4f}",
                         f"{float(r['agree_hf']):.4f}" if "agree_hf" in r else "-"])
    print(format_table(["file", "block types", "ppl fp32 (none)", "ppl native (gguf)",
                        "change", "top-1 vs fp32", "top-1 vs HF"], rows))
    worst = max(abs(float(r[4].rstrip("%"))) for r in rows)
    print(f"SUMMARY gguf_accuracy: worst perplexity change {worst:.3f}% over {len(rows)} files "
          f"({args.tokens} Tempest tokens, {CHUNK}-token forwards) | {hardware_line()}")


if __name__ == "__main__":
    main()
