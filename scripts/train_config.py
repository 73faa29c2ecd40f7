"""Run configs of ``scripts/train.py`` (ml_collections; docs/training.md, "Run configs").

``--config=scripts/train_config.py:demo`` (the demo model on the Shakespeare corpus, sized for
a few minutes on one H200) or ``:tiny`` (the tests' tiny config, a CPU smoke run). Any field
can be overridden on the command line: ``--config.optim.steps=100``.
"""

from ml_collections import ConfigDict


def get_config(name: str = "demo") -> ConfigDict:
    c = ConfigDict()
    c.model = "configs/demo.json"   # a ModelConfig JSON, or "tiny" (benchmarks.config)
    c.data = "data/shakespeare"     # scripts/prepare_data.py's output
    c.out = "out/train/demo"        # checkpoints, history, loss curve, export
    c.seed = 0                      # initial weights and batch order
    c.batch_size = 32
    c.seq_len = 256                 # positions per sequence (a window of seq_len + 1 tokens)
    c.steps = 1000                  # 8.2M tokens: ~6.5 passes over the Shakespeare training text
    c.distill_weight = 1.0          # indexer distillation loss weight
    c.bias_rate = 1e-3              # router bias step (auxiliary-loss-free balancing)
    c.optim = ConfigDict(dict(lr=3e-3, warmup_steps=100, weight_decay=0.1, clip_norm=1.0,
                              b1=0.9, b2=0.95, final_frac=0.1))
    c.log_every = 10                # tqdm postfix / history
    c.eval_every = 100              # validation loss
    c.eval_batches = 8              # validation windows: eval_batches x batch_size
    c.ckpt_every = 250              # orbax checkpoints (and at the end)
    c.keep_checkpoints = 2
    c.resume = True                 # continue from the latest checkpoint in out/
    c.export = True                 # reference-format checkpoint in out/checkpoint
    c.quantised_eval = True         # validation loss of the export under inference numerics
    c.deterministic = True          # XLA GPU deterministic ops (bit-exact resume on a GPU)
    if name == "tiny":
        c.model = "tiny"
        c.out = "out/train/tiny"
        c.batch_size = 2
        c.seq_len = 32
        c.steps = 6
        c.optim.lr = 1e-2
        c.optim.warmup_steps = 2
        c.log_every = 1
        c.eval_every = 3
        c.eval_batches = 1
        c.ckpt_every = 3
    elif name != "demo":
        raise ValueError(f"unknown run config {name!r} (demo, tiny)")
    return c
