"""Transform configs: JSON/YAML round trips, strict keys, and agreement with the Hydra config groups."""
import dataclasses
import json

import pytest

from kvtransform.config import (
    CONFIG_TYPES,
    CanonicalConfig,
    DualKVConfig,
    SpeContextConfig,
    VerifyConfig,
    config_from_dict,
    config_from_json,
    config_from_yaml,
    resolve_config,
)

NON_DEFAULT = {
    "canonical": lambda: CanonicalConfig(verify=VerifyConfig(lengths=[4, 8, 16], tolerance=1e-3, padding=False)),
    "dualkv": lambda: DualKVConfig(verify_groups=[[3, [1, 2]], [7, [5]]], verify=VerifyConfig(seed=3)),
    "specontext": lambda: SpeContextConfig(budget=64, num_sink=4, num_recent=8, retrieval="smollm2-135m",
                                           offload=True),
}


@pytest.mark.parametrize("name", sorted(CONFIG_TYPES))
@pytest.mark.parametrize("which", ["default", "changed"])
def test_round_trip(name, which):
    cfg = CONFIG_TYPES[name]() if which == "default" else NON_DEFAULT[name]()
    assert cfg.name == name
    from_json = config_from_json(cfg.to_json())
    from_yaml = config_from_yaml(cfg.to_yaml())
    assert type(from_json) is type(cfg) and from_json == cfg
    assert type(from_yaml) is type(cfg) and from_yaml == cfg
    assert json.loads(cfg.to_json()) == dataclasses.asdict(cfg)


@pytest.mark.parametrize(
    "d,valid",
    [
        ({"name": "specontext", "budgt": 8}, "budget"),
        ({"name": "canonical", "verfy": {}}, "verify"),
        ({"name": "dualkv", "verify_group": []}, "verify_groups"),
    ],
)
def test_typo_rejected_naming_valid_keys(d, valid):
    with pytest.raises(ValueError, match="Valid keys") as e:
        config_from_dict(d)
    assert valid in str(e.value)


def test_nested_typo_and_bad_type_rejected():
    with pytest.raises(ValueError):
        config_from_dict({"name": "canonical", "verify": {"lenghts": [1]}})
    with pytest.raises(ValueError):
        config_from_dict({"name": "specontext", "budget": "lots"})
    with pytest.raises(ValueError):
        config_from_yaml("name: specontext\nbudget: 8\nofload: true\n")


def test_unknown_transform_name():
    with pytest.raises(ValueError, match="canonical"):
        config_from_dict({"name": "flashattn"})
    with pytest.raises(ValueError, match="dualkv"):
        resolve_config("flashattn")


def test_resolve_config():
    assert resolve_config("dualkv") == DualKVConfig()
    sp = SpeContextConfig(budget=16)
    assert resolve_config(sp) is sp
    assert resolve_config({"name": "specontext", "budget": 16}) == sp
    with pytest.raises(TypeError):
        resolve_config(3)


@pytest.mark.parametrize("name", sorted(CONFIG_TYPES))
def test_hydra_group_matches_dataclass(name):
    """conf/transform/<name>.yaml composes to exactly the dataclass defaults (what optimize passes on)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import kvtransform.cli  # noqa: F401  registers the structured configs

    with initialize_config_module(config_module="kvtransform.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"transform={name}"])
    assert config_from_dict(OmegaConf.to_container(cfg.transform, resolve=True)) == CONFIG_TYPES[name]()
    assert cfg.model.name == "smollm2-135m"


def test_hydra_typo_is_a_composition_error():
    from hydra import compose, initialize_config_module
    from hydra.errors import ConfigCompositionException

    import kvtransform.cli  # noqa: F401

    with initialize_config_module(config_module="kvtransform.conf", version_base="1.3"):
        with pytest.raises(ConfigCompositionException):
            compose(config_name="config", overrides=["transform=specontext", "transform.budgt=4"])
        with pytest.raises(ConfigCompositionException):
            compose(config_name="config", overrides=["transform.verify.batch_size=two"])


def test_verify_given_as_dict():
    """``SpeContextConfig(verify={"enabled": False})`` used to raise AttributeError ('dict' has no 'validate')."""
    from kvtransform.config import resolve_config

    cfg = resolve_config(SpeContextConfig(verify={"enabled": False}))
    assert isinstance(cfg.verify, VerifyConfig) and cfg.verify.enabled is False
    with pytest.raises(ValueError, match="unknown verify key"):
        resolve_config(CanonicalConfig(verify={"enabeld": False}))
    with pytest.raises(ValueError, match="verify must be a VerifyConfig"):
        resolve_config(CanonicalConfig(verify=False))


def test_dotted_keys_nest_and_errors_name_the_key():
    """{"verify.lengths": [9]} is the nested key (what transform.verify.lengths=[9] gives on the command line); a bad
    value names its key in one line; a typo names the closest key of the nested config; a non-string key is named."""
    cfg = config_from_dict({"name": "specontext", "verify.lengths": [9]})
    assert cfg.verify.lengths == [9]
    with pytest.raises(ValueError, match=r"^invalid specontext config: budget: Value 'abc'[^\n]*$"):
        config_from_dict({"name": "specontext", "budget": "abc"})
    with pytest.raises(ValueError, match=r"'lenghts' not in 'VerifyConfig' \(did you mean 'lengths'\?\). Valid keys: "
                                         r"\['enabled', 'lengths'"):
        config_from_dict({"name": "specontext", "verify.lenghts": [9]})
    with pytest.raises(ValueError, match=r"keys must be strings; got \('a',\)"):
        config_from_dict({"name": "dualkv", ("a",): 1})


def test_head_names_and_fuse_choices_match_the_runtime_and_the_passes():
    """config.py keeps the built-in head names and fuse choices as constants (checking a config imports neither the
    runtime nor the passes); they must be the runtime's head registry and the fusion pass's choices."""
    from kvtransform.config import FUSE_CHOICES, HEAD_NAMES
    from kvtransform.passes.fuse_projections import CHOICES
    from kvtransform.runtime.heads import HEADS

    assert set(HEAD_NAMES) == set(HEADS) and len(HEAD_NAMES) == len(set(HEAD_NAMES))
    assert tuple(FUSE_CHOICES) == tuple(CHOICES)


@pytest.mark.parametrize("kwargs,match", [
    (dict(budget=0), "budget must be >= 1"),
    (dict(num_sink=4, num_recent=8, budget=8), "num_sink and num_recent"),
    (dict(page_size=0), "page_size must be >= 1"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be true or false"),
    (dict(fuse_projections="qk"), "fuse_projections must be one of"),
    (dict(head="eagle9"), "unknown retrieval head 'eagle9'"),
])
def test_invalid_specontext_config_is_refused_at_construction(kwargs, match):
    """SpeContextConfig(budget=0) used to be accepted and refused only inside kvt.transform."""
    with pytest.raises(ValueError, match=match):
        SpeContextConfig(**kwargs)
    if "cuda_graphs" not in kwargs:  # (OmegaConf reads "yes" as true on the dict path)
        with pytest.raises(ValueError, match=match):  # the dict / YAML / CLI path gives the same message
            config_from_dict({"name": "specontext", **kwargs})


def test_numpy_integers_are_refused_where_the_config_is_written_as_yaml():
    """Counts must be Python ints: OmegaConf cannot write a NumPy integer, so the artifact's save failed after the
    whole transform had run; refused at construction instead."""
    np = pytest.importorskip("numpy")
    for make, match in ((lambda: SpeContextConfig(budget=8, version=np.int64(1)), "version must be an integer"),
                        (lambda: CanonicalConfig(verify=VerifyConfig(lengths=[np.int64(16)])),
                         "verify.lengths must be integers")):
        with pytest.raises(ValueError, match=match):
            make()


def test_runtime_settings_are_one_dataclass():
    from kvtransform.config import RuntimeConfig

    cfg = SpeContextConfig(compile=True, fuse_projections="qkv", offload=True)
    assert cfg.runtime == RuntimeConfig(cuda_graphs=True, offload=True, compile=True, fuse_projections="qkv",
                                        share_fused_weights=True)
    assert set(f.name for f in dataclasses.fields(RuntimeConfig)) <= set(f.name for f in dataclasses.fields(cfg))
    assert SpeContextConfig().runtime == RuntimeConfig()  # the same defaults
    with pytest.raises(ValueError, match="offload must be true or false"):
        RuntimeConfig(offload=1)


@pytest.mark.parametrize("groups", [[[0, [1]]], [[3, []]], [[3, [2, 0]]], [[3, 2]], [[3, [True]]], [[2.5, [1]]]])
def test_malformed_verify_groups_are_refused_by_the_config(groups):
    """Refused when the config is checked (before optimize loads the model), not when the gate packs them."""
    with pytest.raises(ValueError, match=r"verify_groups entries must be \[prompt_length, \[response_lengths...\]\]"):
        config_from_dict({"name": "dualkv", "verify_groups": groups})
