"""Beyond one process: tensor parallel over torch.distributed (``tp_*``), worker placement by
local processes or Ray (``executor``), data-parallel replicas behind a prefix-aware router
(``router``, ``prefix_tree``, ``dp_server``). See docs/distributed.md."""
