"""`SamplingParams`: every field out of its range raises `SamplingParamError` naming it, with the
range; each field's default is defined once, and docs/serving.md states the same ones."""

import pickle
import re
from pathlib import Path

import pytest

from cairn.cluster.cli import SAMPLING_SHOWN
from cairn.workers import RequestRejected, SamplingParamError, SamplingParams
from cairn.workers.sampling_params import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]

INVALID = [  # (field, a value it refuses); every field at least once
    ("max_tokens", 0), ("max_tokens", True), ("temperature", -0.1), ("temperature", float("nan")),
    ("temperature", 3.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("seed", -1),
    ("seed", 2**64), ("stop_token_ids", [-3]), ("stop_token_ids", "abc"), ("ignore_eos", 1), ("logprobs", 21),
    ("logprobs", -1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("logit_bias", ((1, 101.0),)), ("logit_bias", ((1, 1.0), (1, 2.0))),
    ("min_tokens", DEFAULTS["max_tokens"] + 1), ("grammar", "start: x"),
]


def test_every_field_has_an_invalid_case():
    assert {field for field, _ in INVALID} == set(DEFAULTS)


@pytest.mark.parametrize("field,value", INVALID)
def test_an_invalid_field_raises_the_typed_error_naming_it(field, value):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**{field: value})
    error = e.value
    assert isinstance(error, RequestRejected) and isinstance(error, ValueError)
    assert error.field == error.param == field and error.reason.startswith("must be ")
    assert str(error) == error.message == f"{field} {error.reason}" and repr(value) in error.reason
    copy = pickle.loads(pickle.dumps(error))  # whole across processes (Ray)
    assert (type(copy), copy.field, copy.reason, copy.param) == (SamplingParamError, field, error.reason, field)


def test_the_defaults_are_the_dataclass_fields():
    assert SamplingParams(**DEFAULTS) == SamplingParams()
    assert all(getattr(SamplingParams(), name) == value for name, value in DEFAULTS.items())


def test_docs_serving_states_the_defaults_the_code_defines():
    text = (ROOT / "docs" / "serving.md").read_text()
    sampling = " ".join(text[text.index("## Sampling"):text.index("## Structured outputs")].split())
    sentence = sampling[sampling.index("A field left out"):sampling.index("`seed`.")]
    stated = {name: float(value) for name, value in re.findall(r"`(\w+)` (-?\d+(?:\.\d+)?)", sentence)}
    assert set(SAMPLING_SHOWN) <= set(stated), sentence  # what `cairn serve --help` states, too
    assert stated == {name: DEFAULTS[name] for name in stated}
    assert "no `seed`" in sampling and DEFAULTS["seed"] is None
