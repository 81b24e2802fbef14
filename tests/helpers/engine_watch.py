"""Drive an engine step by step and watch it: the blocks its requests hold, the integrity of
its pools after every step; and spies on which attention paths ran."""
from __future__ import annotations


def run_and_watch(llm, prompts, params, decoding_only: bool = False):
    """Generate step by step: (token ids per prompt, most blocks any request held, logprobs).
    Checks integrity after every step and that every block is back at the end.
    ``decoding_only``: count held blocks only of requests past their prompt."""
    engine = llm.engine
    ids = [engine.add_request(None, p, params) for p in prompts]
    final, most_held = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        most_held = max([most_held] + [engine.kv_manager.num_held_blocks(r.request_id)
                                       for r in engine.scheduler.running
                                       if not decoding_only
                                       or r.num_computed_tokens > r.num_prompt_tokens])
        engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks, "leaked KV blocks"
    outs = [final[i].outputs[0] for i in ids]
    return [o.token_ids for o in outs], most_held, [o.logprobs for o in outs]


def spy_quest_sparse_decodes(monkeypatch) -> list:
    """Layer index of every QUEST sparse decode the Python backend runs (its compiled call or
    its PyTorch path), appended as they run."""
    from kvforge.attention.quest import QuestAttentionBackend
    seen = []
    for name in ("_kernel_sparse_decode", "_sparse_decode"):
        real = getattr(QuestAttentionBackend, name)

        def spy(self, *args, _real=real, **kwargs):
            seen.append(self.layer_idx)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(QuestAttentionBackend, name, spy)
    return seen
