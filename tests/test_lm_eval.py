"""lm-evaluation-harness against launch.serve: its `local-completions` model (echo + logprobs +
max_tokens 1 for loglikelihoods, plain completions for generate_until, tokens read through the
server's vLLM-style /tokenize endpoints: tokenizer_backend "auto" finds them) on a tiny
multiple-choice task and a tiny generate_until task whose data tests/fixtures/lm_eval carries
(nothing is downloaded). Each choice's loglikelihood equals the sum of log_softmax of a plain
forward of the served model over the same tokens, and equals lm-eval's own `hf` backend on the
same float32 checkpoint (transformers); each generation equals spec_jax.generate's greedy text
cut at the task's stop string, though the server speculates (a draft, gamma 2).

The model is a tiny random Qwen2 checkpoint folder (scripts/tiny_checkpoints.py: transformers
writes it, this project converts it), served float32, with the tiny GGUF as its draft."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install -e '.[test]'")
torch = pytest.importorskip("torch", reason="needs torch and transformers: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs torch and transformers")

import serve_support  # noqa: E402
import tiny_gguf  # noqa: E402
from conftest import cache_with_kernels  # noqa: E402

import models  # noqa: E402
import spec_jax  # noqa: E402
from models import convert  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from models.transformer import forward, init_cache  # noqa: E402
from scripts import tiny_checkpoints  # noqa: E402
from spec_jax.engine import Engine  # noqa: E402

TASKS = pathlib.Path(__file__).parent / "fixtures" / "lm_eval"
MC, GEN = "spec_jax_tiny_mc", "spec_jax_tiny_gen"
PER_TOKEN = 1e-4  # nats per continuation token
pytestmark = pytest.mark.xdist_group("serve")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the Qwen2 checkpoint folder, the target converted from it, a Server of it with the tiny
    GGUF as its draft)."""
    root = tmp_path_factory.mktemp("lm_eval")
    gguf = root / "draft.gguf"
    tiny_gguf.write(gguf)
    folder = tiny_checkpoints.save(
        tiny_checkpoints.hf_model("qwen2", num_layers=2, seed=0),
        root / "qwen2",
        Tokenizer.from_gguf(gguf).backend.to_str(),
    )
    cache = cache_with_kernels(root / "cache")
    with pytest.MonkeyPatch.context() as mp:  # converted in this process (no child's start-up)
        mp.setattr(
            convert,
            "convert_in_child",
            lambda name, cache_dir=None, progress=True, **kw: convert.convert(
                name, cache_dir, progress, **kw
            ),
        )
        target = models.load(str(folder), cache_dir=cache, progress=False)
        draft = models.load(str(gguf), cache_dir=cache, progress=False)
    server = serve_support.Server(Engine(target, draft, max_batch=2, max_queue=8, gamma=2, max_context=96))
    yield folder, target, server
    server.close()


def evaluate(model, tasks, tmp_path, monkeypatch, **model_args):
    """lm_eval.simple_evaluate's samples of `tasks` (tests/fixtures/lm_eval's) on `model`, offline."""
    monkeypatch.chdir(TASKS)  # the task files name their data relative to here
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args or None,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    return results["samples"]


def loglikelihoods(samples) -> dict:
    """{(context, continuation): loglikelihood} of a multiple-choice task's samples."""
    out = {}
    for sample in samples:
        for (context, continuation), (ll, _) in zip(
            sample["arguments"], sample["filtered_resps"], strict=True
        ):
            out[context, continuation] = float(ll)
    return out


def direct(model, context: str, continuation: str) -> tuple[float, int]:
    """(the continuation's loglikelihood by a plain forward of the model, its token count), with
    lm-eval's split of the pair into tokens (the context's, then the rest of the whole's)."""
    encode = lambda text: model.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, start = encode(context + continuation), len(encode(context))
    tokens = jnp.asarray([whole], jnp.int32)
    out = forward(
        model.config,
        model.params,
        tokens,
        jnp.arange(len(whole))[None],
        init_cache(model.config, 1, len(whole)),
    )
    lp = np.asarray(jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1))
    return float(sum(lp[t - 1, whole[t]] for t in range(start, len(whole)))), len(whole) - start


def test_lm_eval_local_completions_scores_as_the_model_and_as_its_hf_backend(served, tmp_path, monkeypatch):
    folder, target, server = served
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=server.url + "/v1/completions", model=serve_support.MODEL, max_retries=1
    )
    assert lm.tokenizer_backend == "remote"  # found the server's /tokenizer_info and /tokenize
    samples = evaluate(lm, [MC, GEN], tmp_path, monkeypatch)
    served_ll = loglikelihoods(samples[MC])
    assert len(served_ll) == 11  # every choice of the four questions
    for (context, continuation), ll in served_ll.items():
        want, n = direct(target, context, continuation)
        assert abs(ll - want) <= PER_TOKEN * n, (context, continuation, ll, want)
    # generate_until: the server's greedy text (drafted) is spec_jax.generate's, cut at "\n"
    for sample in samples[GEN]:
        ids = target.tokenizer.encode(sample["arguments"][0][0], add_special_tokens=False)
        text = spec_jax.generate(target, [ids], max_new_tokens=6, temperature=0.0).text[0]
        assert sample["resps"][0][0] == text.split("\n")[0], sample

    hf = evaluate("hf", [MC], tmp_path, monkeypatch, pretrained=str(folder), dtype="float32", device="cpu")
    hf_ll = loglikelihoods(hf[MC])
    assert hf_ll.keys() == served_ll.keys()
    for key, ll in served_ll.items():
        n = direct(target, *key)[1]
        assert abs(ll - hf_ll[key]) <= PER_TOKEN * n, (key, ll, hf_ll[key])
    assert os.getcwd() == str(TASKS)
