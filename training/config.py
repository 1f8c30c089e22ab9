"""The settings of a draft-head training run: the schema (default_config, with a comment on each
field), the ranges every setting must be in (validate), and the head's ModelConfig they give."""

import ml_collections

from models import draft_head, settings
from models.config import ModelConfig


def default_config() -> ml_collections.ConfigDict:
    """The settings of a draft-head training run (launch/configs/draft_head.py starts from here)."""
    c = ml_collections.ConfigDict()
    c.target = "qwen2.5-coder-1.5b"
    c.target_dtype = "int8"  # the precision whose features the head learns (models.precision)
    c.corpora = ("code", "news")  # models.corpora tasks; their training split only
    c.train_tokens = 150_000
    c.eval_tokens = 16_384  # from the held-out split
    c.seq_len = 256
    c.vocab = 32768  # drafted token set: the most frequent training tokens (0: the whole vocabulary)
    c.head_layers = 1  # the head's shape; 0 below means the target's own
    c.head_heads = 0
    c.head_kv_heads = 0
    c.head_mlp_dim = 0
    c.init_from_target = True  # start the head's layers from the target's last layers where shapes allow
    c.identity_init = True  # start the head as h_j = f_j (fc = [I, 0], output projections zero)
    c.batch_size = 8
    c.steps = 300
    c.learning_rate = 5e-4
    c.warmup_steps = 30
    c.end_learning_rate_factor = 0.05
    c.weight_decay = 0.01
    c.clip_norm = 0.5
    c.regression_weight = 1.0
    c.token_weight = 1.0
    c.feature_noise = 0.1  # Gaussian noise on input features, relative to their RMS
    c.token_loss_stride = (
        4  # the cross-entropy at every k-th position (its output head dominates a step's cost)
    )
    c.eval_every = 50
    c.checkpoint_every = 50
    c.eval_windows = 32
    c.seed = 0
    return c


INT_RANGES = {
    "train_tokens": (16, 10**9),
    "eval_tokens": (16, 10**8),
    "seq_len": (16, 8192),
    "vocab": (0, 10**7),
    "batch_size": (1, 4096),
    "steps": (1, 10**8),
    "warmup_steps": (0, 10**8),
    "eval_every": (1, 10**8),
    "checkpoint_every": (1, 10**8),
    "eval_windows": (1, 10**6),
    "token_loss_stride": (1, 4096),
    "seed": (0, 2**31 - 1),
}
FLOAT_RANGES = {
    "learning_rate": (0.0, 1.0),
    "end_learning_rate_factor": (0.0, 1.0),
    "weight_decay": (0.0, 1.0),
    "clip_norm": (0.0, 1e6),
    "regression_weight": (0.0, 1e6),
    "token_weight": (0.0, 1e6),
    "feature_noise": (0.0, 10.0),
}


def validate(config, known_corpora=None) -> None:
    """ValueError("<key>: ...") for a setting out of range (the head's shape is checked against
    the target by head_config)."""
    settings.check_int_settings(config, INT_RANGES)
    settings.check_number_settings(config, FLOAT_RANGES)
    if config.learning_rate <= 0:
        raise ValueError(f"learning_rate: must be positive, got {config.learning_rate}")
    if config.regression_weight + config.token_weight <= 0:
        raise ValueError("regression_weight, token_weight: at least one must be positive")
    if known_corpora is not None:
        corpora = tuple(config.corpora)
        unknown = [c for c in corpora if c not in known_corpora]
        if not corpora or unknown:
            raise ValueError(
                f"corpora: unknown corpus {unknown[0] if unknown else '(none given)'}; known corpora: "
                f"{', '.join(known_corpora)}"
            )
    for key in ("head_layers", "head_heads", "head_kv_heads", "head_mlp_dim"):
        v = config[key]
        if not settings.is_int(v) or v < 0:
            raise ValueError(f"{key}: must be an integer >= 0 (0: the target's), got {v!r}")


def head_config(config, target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig (float32, XLA products: differentiable) from the training config;
    ValueError naming the head_* key of a head wider or deeper than the target."""
    keys = {"num_layers": "head_layers", "num_heads": "head_heads", "num_kv_heads": "head_kv_heads"}
    keys["mlp_dim"] = "head_mlp_dim"
    try:
        return draft_head.config_for(
            target,
            num_layers=config.head_layers or 1,
            num_heads=config.head_heads or None,
            num_kv_heads=config.head_kv_heads or None,
            mlp_dim=config.head_mlp_dim or None,
            dtype="float32",
            matmul_impl="xla",
        )
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        raise ValueError(f"{keys.get(name, name)}: {rest}") from None
