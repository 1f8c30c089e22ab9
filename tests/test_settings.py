"""The one rule for integer and number settings (models.settings): a bool is neither, every
argument check and config check applies the same rule, and no module writes it again."""

import ast
import pathlib

import numpy as np
import pytest

from models import settings
from spec_jax import sampling
from spec_jax.drafting import lookup, ngram, suffix_table

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_bool_is_neither_an_integer_nor_a_number_and_numpy_scalars_are():
    assert settings.is_int(3) and settings.is_int(np.int32(3))
    assert settings.is_number(0.5) and settings.is_number(np.float32(0.5)) and settings.is_number(2)
    for value in (True, False):
        assert not settings.is_int(value) and not settings.is_number(value)
    assert not settings.is_int(2.0) and not settings.is_int("2") and not settings.is_number("2")


def test_a_setting_out_of_range_gets_one_line_naming_the_key_and_its_range():
    settings.check_int_settings({"steps": 4}, {"steps": (1, 8)})
    with pytest.raises(ValueError, match=r"^steps: must be an integer in \[1, 8\], got True$"):
        settings.check_int_settings({"steps": True}, {"steps": (1, 8)})
    with pytest.raises(ValueError, match=r"^steps: must be an integer in \[1, 8\], got 9$"):
        settings.check_int_settings({"steps": 9}, {"steps": (1, 8)})
    with pytest.raises(ValueError, match=r"^rate: must be a number in \[0.0, 1.0\], got '0.5'$"):
        settings.check_number_settings({"rate": "0.5"}, {"rate": (0.0, 1.0)})


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sampling.validate_sampling(1.0, True, 1.0), "top_k must be an integer"),
        (
            lambda: suffix_table.fit_suffix_tables([[1, 2, 3]], 4, max_ngram=True),
            "max_ngram must be an integer",
        ),
        (lambda: ngram.most_frequent([[1, 2, 3]], 4, True), "count must be an integer"),
        (lambda: lookup.PromptLookupDrafter(8, max_ngram=True), "max_ngram must be an integer"),
    ],
)
def test_argument_checks_refuse_a_bool_where_an_integer_belongs(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_no_module_outside_models_settings_writes_the_bool_rule_again():
    """`isinstance(v, bool)` beside an integer check is models.settings' job alone."""
    found = []
    for package in ("models", "spec_jax", "training", "experiments", "launch"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "models" / "settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "id", None) == "isinstance"
                    and len(node.args) == 2
                    and getattr(node.args[1], "id", None) == "bool"
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"use models.settings.is_int / is_number: {found}"
