import pytest
from omegaconf import OmegaConf

from wnw_exp.data import READERS, build_dataset
from wnw_exp.data.synthetic import SyntheticDataset
from wnw_exp.paths import conf_dir

CONF = conf_dir() / "dataset"


@pytest.mark.parametrize("name", sorted(READERS))
def test_every_reader_has_a_config_with_common_options(name):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    assert cfg.name == name
    for key in ("split", "n", "seed", "shard", "num_shards"):
        assert key in cfg, f"{name}.yaml lacks {key}"


def test_synthetic_config_builds(tmp_path):
    cfg = OmegaConf.load(CONF / "synthetic.yaml")
    cfg.cache_dir = str(tmp_path)
    ds = build_dataset(cfg)
    assert isinstance(ds, SyntheticDataset) and len(ds) == 4 and ds.split == "test"
    assert (ds.min_seconds, ds.max_seconds) == (40.0, 60.0) and ds.text == "natural"


def test_env_interpolation_gives_null_then_a_clear_error(monkeypatch):
    monkeypatch.delenv("WNW_LIBRISPEECH_LONG", raising=False)
    cfg = OmegaConf.load(CONF / "librispeech_long.yaml")
    with pytest.raises(ValueError, match="WNW_LIBRISPEECH_LONG"):
        build_dataset(cfg)


def test_unknown_dataset():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset({"name": "nope"})
