"""The ModelRunner of an offloaded model: builds (once, in a child process) or opens the weight
store, calibrates the hardware (cached), lets the policy place layers and size the block, then
runs the ordinary ModelRunner over an ``OffloadedLM``. The policy's block (batch_size x
block_batches sequences) becomes the scheduler's ``max_num_seqs``: one engine step is one
block, so continuous batching refills it as sequences finish."""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import shutil

import torch

from kvforge.config import EngineConfig
from kvforge.engine.model_runner import ModelRunner
from kvforge.loader.source import ModelSource
from kvforge.models.layerwise import layerwise_family
from kvforge.models.registry import get_model_class
from kvforge.offload.calibrate import load_or_measure
from kvforge.offload.cost_model import (SAMPLE_ROWS_PER_CALL, ModelFacts, Workload,
                                        decode_step_s)
from kvforge.offload.direct_io import AlignedBuffer
from kvforge.offload.kv_disk import DiskKVLayer
from kvforge.offload.kv_slots import DiskSlotMap
from kvforge.offload.layer_timing import time_layer_blocks
from kvforge.offload.policy import MAX_BLOCK_BATCHES, choose_placement, parse_policy
from kvforge.offload.store_builder import ensure_store
from kvforge.offload.streamed_model import OffloadedLM, bound_heap
from kvforge.offload.trace import TraceRecorder
from kvforge.offload.weight_store import WeightStore, release_layer, store_key
from kvforge.quant.loading import auto_quantization, load_model

logger = logging.getLogger(__name__)

PLANNED_SEQ_LEN_MAX = 512     # KV planned per sequence when max_model_len is the model's context


def model_facts(skeleton, store: WeightStore) -> ModelFacts:
    cfg = skeleton.config
    layer_params = sum(e.get("params", math.prod(e["shape"])) for e in store.layers[0]["tensors"])
    vocab, hidden = store.head["shape"]
    fixed = sum(b.numel() * b.element_size()
                for rotary in layerwise_family(type(skeleton)).rotaries(skeleton.model)
                for b in rotary.buffers())
    fixed += 4 * hidden * (2 * skeleton.num_layers + 1)             # the norms
    return ModelFacts(
        num_layers=skeleton.num_layers, layer_bytes=store.layer_bytes, layer_params=layer_params,
        head_bytes=store.head_bytes, head_params=vocab * hidden, stage_bytes=store.stage_bytes,
        hidden_size=hidden, intermediate_size=cfg.intermediate_size, vocab_size=vocab,
        kv_bytes_per_token_layer=skeleton.kv_cache_bytes_per_token() // skeleton.num_layers,
        fixed_bytes=fixed)


def check_streamable(source: ModelSource) -> None:
    """The streamed forward runs the families of ``models/layerwise.py`` (Llama, Mistral, Qwen2,
    Mixtral, Qwen2-MoE, Gemma 3); others (GPT-2, DeepSeek-V2's latent attention) would run
    wrong, so they are refused by name."""
    layerwise_family(get_model_class(source.config.architecture))


def _has_gguf_experts(model) -> bool:
    from kvforge.quant.gguf_experts import GGUFExpertsMethod
    return any(isinstance(getattr(m, "method", None), GGUFExpertsMethod) for m in model.modules())


def remove_stale_kv_dirs(offload_dir: str) -> None:
    """Remove ``kv-<pid>`` directories of processes no longer running (left by versions that
    kept the KV files' names until shutdown)."""
    from kvforge.processes import pid_exists
    try:
        names = os.listdir(offload_dir)
    except FileNotFoundError:
        return
    for name in names:
        pid = name.removeprefix("kv-")
        if not name.startswith("kv-") or not pid.isdigit() or pid_exists(int(pid)):
            continue
        shutil.rmtree(os.path.join(offload_dir, name), ignore_errors=True)


class OffloadModelRunner(ModelRunner):
    # the tuner times each weight shape over cold copies of up to 256 MiB, which a memory
    # budget cannot hold (peak RSS 200+ MiB over a 128 MiB budget on a first start): cached
    # plans apply, missing ones run the build's defaults until `kvforge tune` times them
    times_kernels_at_start = False
    sample_rows_per_call = SAMPLE_ROWS_PER_CALL      # the budget counts one call's copies

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self._max_model_len = max_model_len
        bound_heap()        # before the engine allocates (streamed_model.bound_heap says why)
        super().__init__(config, source, max_model_len)
        # disk-KV layers: their pool is a file; the RAM tensors of those layers stay untouched
        # (anonymous pages never written cost nothing)
        remove_stale_kv_dirs(config.offload_dir_path)
        os.makedirs(config.offload_dir_path, exist_ok=True)
        block_shape = tuple(self.kv_caches[0].shape[2:])
        # RAM-KV layers in ordinary pages, faulted in as tokens arrive: the huge-page pool
        # faults 2 MiB per layer for the first token, which a tight budget cannot spare; the
        # disk-KV layers' RAM pools are never touched (zeros of this size are lazily mapped)
        self._kv_buffers = [AlignedBuffer(c.numel() * c.element_size()) for c in self.kv_caches]
        self.kv_caches = [b.tensor[:c.numel() * c.element_size()].view(c.dtype).view(c.shape)
                          for b, c in zip(self._kv_buffers, self.kv_caches)]
        disk_layers = self.placement.kv_disk_layers
        slots = DiskSlotMap(self.num_blocks) if disk_layers else None
        self.model.attach_kv_disk({
            # unlinked once open (kv_disk.py): the name only has to be unique while it lasts
            j: DiskKVLayer(os.path.join(config.offload_dir_path,
                                        f"kv-{os.getpid()}-layer_{j:04d}.kv"),
                           slots.capacity, block_shape, self.kv_caches[0].dtype)
            for j in disk_layers}, slots)
        # at shutdown, or at exit for callers that never shut the engine down (kvforge generate)
        self._trace_written = False
        if config.offload_trace:
            atexit.register(self._write_trace)

    def _load_model(self, source: ModelSource) -> torch.nn.Module:
        config = self.config
        check_streamable(source)
        # a GGUF file streams its own blocks where they run natively (as --quantization auto
        # would run it in memory); anything else, and quantization "none", fp32 rows
        quantization = "none"
        if config.quantization in ("auto", "gguf") and \
                auto_quantization(source, self.dtype, self.device) == "gguf":
            quantization = "gguf"
        elif config.quantization == "gguf":
            raise ValueError("offloading with quantization 'gguf' needs a GGUF file and the "
                             "compiled CPU kernels")
        skeleton = None
        if quantization == "gguf":
            # the layers' block layout (types, shards) comes from the file; its bytes are
            # dropped at once (the map, and the RAM copies of llama.cpp-ordered q/k rows)
            skeleton = load_model(source, quantization="gguf",
                                  attn_backend=config.attention_backend, dtype=self.dtype,
                                  device=self.device)
            if _has_gguf_experts(skeleton):
                # MoE experts keep their blocks outside the layer's tensors: not streamable
                if config.quantization == "gguf":
                    raise ValueError("offloading a GGUF file's MoE experts in their own blocks "
                                     "is not supported; use quantization='none' (fp32 rows)")
                logger.info("offload: MoE experts stream as fp32 rows (quantization 'none')")
                quantization, skeleton = "none", None
            else:
                for layer in skeleton.model.layers:
                    release_layer(layer)
        if skeleton is None:
            skeleton = get_model_class(source.config.architecture)(
                source.config, attn_backend=config.attention_backend, dtype=self.dtype,
                device=self.device)
        config.quantization = quantization
        directory = os.path.join(config.offload_dir_path,
                                 f"store-{store_key(source.path, quantization, config.dtype)}")
        built = ensure_store(source.path, directory, config.dtype, quantization)
        if built:
            logger.info("offload: weight store built in %.1f s at %s", built, directory)
        store = WeightStore(directory)
        skeleton.requires_grad_(False)
        hw, measured = load_or_measure(config.offload_dir_path)
        logger.info("offload: disk tier %.0f MB/s direct reads (%s, %s)",
                    hw.disk_read_bytes_per_s / 1e6,
                    "O_DIRECT" if store.direct else "buffered + posix_fadvise(DONTNEED)",
                    "measured now" if measured else "cached calibration")
        workload = Workload(seq_len=min(self._max_model_len, PLANNED_SEQ_LEN_MAX),
                            step_tokens=config.max_num_batched_tokens,
                            block_size=config.block_size)
        facts = dataclasses.replace(
            model_facts(skeleton, store),
            layer_block_s=time_layer_blocks(skeleton, store, config.offload_batch_size,
                                            workload.seq_len, config.block_size,
                                            config.offload_block_batches or MAX_BLOCK_BATCHES))
        logger.info("offload: one layer on blocks of batches of %d decodes: %s",
                    config.offload_batch_size,
                    ", ".join(f"{n} batches {s * 1e3:.2f} ms" for n, s in facts.layer_block_s))
        placement = choose_placement(parse_policy(config.offload_policy), facts, hw, workload,
                                     config.offload_memory_budget_bytes,
                                     config.offload_batch_size, config.offload_block_batches)
        logger.info("%s", placement.describe())
        self.placement, self.hardware, self.facts = placement, hw, facts
        self.workload = workload
        # one engine step is one block (engine/llm_engine builds the scheduler after the runner)
        config.max_num_seqs = placement.block_seqs
        return OffloadedLM(skeleton, store, placement, TraceRecorder())

    @property
    def attention_model(self) -> torch.nn.Module:
        return self.model.inner       # the skeleton's layers attend; OffloadedLM streams them

    def predicted_decode_step_s(self, seqs: int) -> float:
        """The cost model's seconds for a decode step of ``seqs`` sequences under the chosen
        placement: the batches they fill (the placement's own prediction is for a full
        block), so a run that fills part of the block is compared with its own prediction."""
        if seqs < 1:
            raise ValueError(f"a decode step has at least one sequence, got {seqs}")
        p = self.placement
        return decode_step_s(self.facts, self.hardware, self.workload, p.batch_size,
                             math.ceil(seqs / p.batch_size), p.counts, p.overlap)

    def _num_kv_blocks(self, max_model_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_layer_block = self.model.kv_cache_bytes_per_block(self.block_size) // self.model.num_layers
        return max(1, self.placement.kv_pool_bytes // per_layer_block)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies])
        dst = torch.tensor([d for _, d in copies])
        slot_of = self.model.kv_slots.slot_of if self.model.kv_slots is not None else None
        for j, cache in enumerate(self.kv_caches):
            disk = self.model.kv_disk.get(j)
            if disk is not None:
                disk.copy_slots([(slot_of[s], slot_of[d]) for s, d in copies])
            else:
                cache[:, dst] = cache[:, src]

    def check_integrity(self) -> None:
        if self.model.kv_slots is not None:
            self.model.kv_slots.check_integrity()

    @property
    def supports_decode_steps(self) -> bool:
        return False        # the compiled multi-step decode holds every weight resident

    def _write_trace(self) -> None:
        if self.config.offload_trace and not self._trace_written:
            self.model.trace.write(self.config.offload_trace)
            self._trace_written = True

    def shutdown(self) -> None:
        self._write_trace()
        self.model.close()
