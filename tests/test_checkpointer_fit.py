"""`fit.state_mismatch` names the first reason a saved state is not a model: a tensor of another size before one the
state lacks, before one the model lacks; a tensor saved in another layout of the same size (an ETP-saved w13) fits."""

from __future__ import annotations

from services.checkpointer.fit import config_diff, diff_hint, state_mismatch

MODEL = {"embed.weight": (10, 4), "layers.0.w13": (2, 4, 6), "norm.weight": (4,)}


def test_a_state_of_the_same_sizes_fits_even_in_another_layout():
    assert state_mismatch({**MODEL, "layers.0.w13": (2, 4, 2, 3)}, MODEL) is None


def test_a_wrong_size_is_named_before_missing_and_extra_tensors():
    saved = {"embed.weight": (10, 8), "extra.bias": (3,)}
    assert state_mismatch(saved, MODEL) == "'embed.weight' is [10, 8] there but [10, 4] in this model"


def test_missing_tensors_are_named_before_extra_ones_and_counted():
    assert state_mismatch({"embed.weight": (10, 4), "extra.bias": (3,)}, MODEL) == (
        "it has no 'layers.0.w13' (nor 1 more)")
    assert state_mismatch({**MODEL, "a": (1,), "b": (1,)}, MODEL) == "it holds 'a' (and 1 more), which this model lacks"


def test_the_hint_names_each_model_field_the_checkpoints_run_had_otherwise():
    mine = {"hidden_size": 4, "num_layers": 2}
    assert config_diff({"hidden_size": 8, "num_layers": 2, "gone": 1}, mine) == ["model.hidden_size=8 there, 4 here"]
    assert diff_hint(None, mine) == "" and diff_hint({"hidden_size": 4}, mine) == ""
    assert diff_hint({"hidden_size": 8}, mine) == "; the checkpoint's run had model.hidden_size=8 there, 4 here"
