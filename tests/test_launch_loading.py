"""launch.loading.load_pair, the one loader of a target and its draft (launch.generate, launch.serve
and the experiments): the order of its steps (the target's check before anything of the draft is
read), no draft model for None, and the tokenizer pair check as one UsageError naming both."""

import pytest

import models
from launch.loading import Pair, load_pair
from launch.usage import UsageError


class Renamed(models.ByteTokenizer):
    """The byte tokenizer with token 65 spelled differently: not the target's vocabulary."""

    def id_to_token(self, i):
        return "hi" if i == 65 else super().id_to_token(i)


def tiny(seed: int, tokenizer=None) -> models.Model:
    model = models.random_model(
        vocab_size=256, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, seed=seed
    )
    return model.replace(tokenizer=tokenizer or models.ByteTokenizer())


@pytest.fixture(scope="module")
def zoo():
    """{name: a tiny model}: "t" the target, "d" a draft with its tokenizer, "other" a draft without."""
    return {"t": tiny(0), "d": tiny(1), "other": tiny(2, Renamed())}


def recording_loader(zoo, log):
    def load(name, dtype):
        log.append((name, dtype))
        return zoo[name]

    return load


def test_the_target_is_checked_before_anything_of_the_draft_is_read(zoo):
    log, checked = [], []

    def refuse(target):
        checked.append(target)
        raise UsageError("--gamma: too long for the target's context")

    with pytest.raises(UsageError, match="--gamma"):
        load_pair("t", "d", target_dtype="int8", load=recording_loader(zoo, log), check_target=refuse)
    assert log == [("t", "int8")] and checked == [zoo["t"]]


def test_both_checks_see_the_models_in_order_and_the_pair_is_returned(zoo):
    log, calls = [], []
    pair = load_pair(
        "t",
        "d",
        target_dtype="float32",
        draft_dtype="bfloat16",
        load=recording_loader(zoo, log),
        check_target=lambda target: calls.append(("target", target)),
        check_draft=lambda target, draft: calls.append(("draft", target, draft)),
    )
    assert pair == Pair(zoo["t"], zoo["d"])
    assert log == [("t", "float32"), ("d", "bfloat16")]
    assert calls == [("target", zoo["t"]), ("draft", zoo["t"], zoo["d"])]


def test_no_draft_model_is_loaded_for_none(zoo):
    log = []
    pair = load_pair("t", None, load=recording_loader(zoo, log), check_draft=lambda *a: pytest.fail("called"))
    assert pair == Pair(zoo["t"], None) and log == [("t", "auto")]


def test_a_draft_with_another_vocabulary_is_one_usage_error_naming_both(zoo):
    with pytest.raises(UsageError) as e:
        load_pair("t", "other", load=recording_loader(zoo, []))
    message = str(e.value)
    assert message.startswith("--draft=other and --target=t: ") and "token id 65" in message
    assert len(message.splitlines()) == 1
