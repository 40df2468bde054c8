"""The retention promise (test_retention_promise.py) on the random-weight Voxtral (3 layers, 8 query / 4 KV heads) and
Qwen2.5-Omni (2 layers, 8 query / 2 KV heads, M-RoPE) shapes of tests/helpers.py: every method x retentions 0.1, 0.2,
0.4, 0.8 x a short and a long clip, the peak counted at every layer's attention."""

import pytest
from test_retention_promise import METHODS, SHORT_LONG, attention_peak, backbone_and_scores, check_promise  # noqa: F401


@SHORT_LONG
@pytest.mark.parametrize("model", ["voxtral", "qwen_omni"])
@pytest.mark.parametrize("name", METHODS)
def test_every_method_keeps_the_peak_at_or_under_the_target(name, model, seconds, attention_peak):  # noqa: F811
    backbone, scores = backbone_and_scores(model)
    check_promise(backbone, scores, name, seconds, attention_peak)
