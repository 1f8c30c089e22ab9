"""The HF transformers side of `launch.bench --suite=peer`: loads once, then serves JSON lines.

Runs in the reference interpreter (`.venv-ref`: torch, transformers, accelerate, gguf; no
jax), started by experiments/bench_peer.py as a subprocess; the protocol, the common flags and
the `--fake` backend are launch/peer_protocol.py's:

    .venv-ref/bin/python -m launch.hf_peer_worker --target=T.gguf --draft=D.gguf --threads=2 \\
        --dtype=float32

Both models come from the GGUF files through `AutoModelForCausalLM.from_pretrained(dir,
gguf_file=..., dtype=--dtype)` (dequantized to float32 or bfloat16); greedy (do_sample=False),
EOS disabled (generation_config.eos_token_id = None) so that every run generates exactly
max_new_tokens. A speculative request is HF's assisted generation with the draft as
`assistant_model`, with HF's own defaults for the assistant (what a user gets).
"""

import importlib.metadata
import os
import sys

from launch import peer_protocol

ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
DTYPES = ("float32", "bfloat16")


class HFBackend:
    """AutoModelForCausalLM from the GGUF files in `dtype`, greedy; the draft as assistant_model."""

    def __init__(self, target_gguf: str, draft_gguf: str, threads: int, dtype: str = "float32"):
        # Optional dependency, imported late: torch and transformers (the hf extra) are this peer's
        # alone and may be missing where the bench runs the worker with --fake.
        import torch
        import transformers

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        transformers.utils.logging.disable_progress_bar()  # stderr is the bench's console
        torch.set_num_threads(threads)
        self.torch, self.transformers, self.dtype = torch, transformers, dtype

        def load(path):
            folder, name = os.path.split(os.path.abspath(path))
            model = transformers.AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=getattr(torch, dtype)
            )
            model.generation_config.eos_token_id = None  # never stop early: exactly max_new_tokens
            model.generation_config.pad_token_id = 0
            return model.eval()

        self.target = load(target_gguf)
        self.draft = load(draft_gguf)

    def info(self) -> dict:
        config = self.draft.generation_config  # HF reads the assistant settings from the assistant
        generation_config = self.transformers.GenerationConfig
        defaults = getattr(generation_config, "_get_default_generation_params", dict)()  # what None means
        return {
            "versions": {
                "python": sys.version.split()[0],
                "torch": self.torch.__version__,
                "transformers": self.transformers.__version__,
                "accelerate": importlib.metadata.version("accelerate"),
            },
            "threads": self.torch.get_num_threads(),
            "precision": self.dtype,
            "assistant": {
                k: v if (v := getattr(config, k, None)) is not None else defaults.get(k)
                for k in ASSISTANT_KEYS
            },
        }

    def generate(self, request: peer_protocol.Request) -> dict:
        torch = self.torch
        ids = torch.tensor([request.prompt], dtype=torch.long)
        kwargs = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=request.max_new_tokens,
            do_sample=False,
            temperature=None,
            top_k=None,
            top_p=None,
        )
        if request.speculative:  # HF's own assistant settings; request.draft_max is not used
            kwargs["assistant_model"] = self.draft
        with torch.inference_mode():
            out = self.target.generate(ids, **kwargs)
        return {"tokens": out[0, len(request.prompt) :].tolist()}


def add_arguments(parser) -> None:
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="torch dtype of both models")


def make_backend(args) -> HFBackend:
    return HFBackend(args.target, args.draft, args.threads, args.dtype)


if __name__ == "__main__":
    sys.exit(peer_protocol.main(__doc__, make_backend, add_arguments))
