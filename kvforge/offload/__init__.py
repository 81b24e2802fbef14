"""Offloading (FlexGen, Sheng et al. 2023): run a model whose weights do not fit the memory
budget by streaming its layers from a disk tier, with an LP-chosen placement, a zig-zag block
schedule (one weight load per layer per step serves every batch of the block) and a loader
thread that overlaps the next stage's read with this stage's compute. See docs/offload.md."""
