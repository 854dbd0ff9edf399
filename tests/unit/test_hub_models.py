"""Models by Hugging Face id (diffpipe/hub.py), read from a hub cache built offline in the hub's layout."""

from __future__ import annotations

import shutil

import pytest
import yaml
from hubcache import add_snapshot
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from diffpipe import hub
from diffpipe.cli import app
from diffpipe.config import ConfigError, ModelConfig
from diffpipe.data.dataset.demo import write_demo_dataset
from diffpipe.families import get_family, resolve_family
from diffpipe.init import resolve_model
from diffpipe.resolve import parse_config

REPO = "some-org/tiny-model"
REV_A, REV_SAME, REV_B = "a" * 40, "c" * 40, "b" * 40
VAE_FILE = "vae/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """Snapshots of one tiny SD pipeline: A (main), the same files under another commit, B with another VAE."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("hub")
        mp.setenv("DIFFPIPE_CACHE", str(root / "store"))
        mp.setenv("HF_HUB_CACHE", str(root / "hub"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        folder = root / "tiny-sd"
        get_family(ModelConfig(family="sd", flavor="tiny")).load_pipeline().save_pretrained(folder)
        add_snapshot(root / "hub", REPO, folder, REV_A)
        add_snapshot(root / "hub", REPO, folder, REV_SAME, ref=None)
        other = root / "tiny-sd-b"
        shutil.copytree(folder, other)
        weights = load_file(other / VAE_FILE)
        first = sorted(weights)[0]
        weights[first] = weights[first] + 0.01
        save_file(weights, other / VAE_FILE)
        add_snapshot(root / "hub", REPO, other, REV_B, ref=None)
        yield root


@pytest.mark.parametrize("value, is_id", [("org/name", True), ("black-forest-labs/FLUX.1-dev", True),
                                          ("./org/name", False), ("/abs/name", False), ("one", False),
                                          ("a/b/c", False), ("org/name/", False)])
def test_what_counts_as_an_id(value, is_id, tmp_path):
    assert hub.is_model_id(value, tmp_path) is is_id


def test_an_existing_local_folder_is_never_an_id(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not hub.is_model_id("org/name", tmp_path)
    assert hub.split_file_id("org/name/f.safetensors", tmp_path) == ("org/name", "f.safetensors")
    (tmp_path / "org" / "name" / "f.safetensors").write_bytes(b"")
    assert hub.split_file_id("org/name/f.safetensors", tmp_path) is None


def test_an_id_resolves_to_its_snapshot_and_names_the_family(hub_cache):
    cfg = ModelConfig(path=REPO)  # no flavor, no family: parsing reads no file
    assert (cfg.flavor, cfg.family, cfg.origin) == ("local", None, REPO)
    assert resolve_family(cfg).family == "sd"  # the resolution step reads the id's model_index.json
    family = get_family(cfg)
    assert family.cfg.path == str(hub_cache / "hub" / "models--some-org--tiny-model" / "snapshots" / REV_A)
    assert family.cfg.origin == REPO  # what export metadata names
    assert ModelConfig().flavor == "tiny" and ModelConfig(path=REPO, flavor="tiny").flavor == "tiny"


def test_a_family_that_does_not_match_the_model_is_an_error(hub_cache):
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"family": "flux", "path": REPO}, "datasets": [{"name": "d", "path": "x"}]})
    assert "model.family 'flux'" in str(err.value) and "sd pipeline" in str(err.value) and REPO in str(err.value)
    # A local folder too (its model_index.json), with the right family still accepted.
    folder = str(hub_cache / "tiny-sd")
    with pytest.raises(ConfigError, match=r"model.family 'wan' does not match .*names a sd pipeline"):
        parse_config({"model": {"family": "wan", "path": folder}, "datasets": [{"name": "d", "path": "x"}]})
    assert parse_config({"model": {"family": "sd", "path": folder}, "datasets": [{"name": "d", "path": "x"}]})


def test_cache_keys_follow_the_snapshot_content(hub_cache):
    def keys(revision):
        family = get_family(ModelConfig(path=REPO, revision=revision))
        return family.vae_identity(), family.text_identity()

    main, same, other = keys(None), keys(REV_SAME), keys(REV_B)
    assert main == same  # another commit with the same files: nothing re-encodes
    assert other[0] != main[0] and other[1] == main[1]  # another VAE: latents re-encode, text does not


def test_a_missing_id_names_the_id_and_the_cache_folder(hub_cache):
    with pytest.raises(ConfigError) as err:
        parse_config({"model": {"path": "some-org/absent-model"}, "datasets": [{"name": "d", "path": "x"}]})
    text = str(err.value)
    assert "'some-org/absent-model/model_index.json'" in text and str(hub_cache / "hub") in text
    assert "model.path" in text and "huggingface-cli download some-org/absent-model`" in text
    with pytest.raises(hub.HubError, match=r"revision 'dddd.*not in the hub cache"):
        hub.snapshot(REPO, "d" * 40)


def test_single_files_by_id(hub_cache):
    cfg = ModelConfig(path=REPO, single_files={"vae": f"{REPO}/{VAE_FILE}"})
    family = get_family(cfg)
    blob = family.cfg.single_files["vae"]
    assert "/blobs/" not in blob and blob.endswith(VAE_FILE)  # the snapshot's link, read through the cache
    assert family.vae_weights_identity() == get_family(ModelConfig(path=REPO)).vae_weights_identity()


def test_init_accepts_an_id(hub_cache, tmp_path, monkeypatch):
    assert resolve_model(REPO) == ModelConfig(family="sd", flavor="local", path=REPO)
    write_demo_dataset(tmp_path / "shapes", n=2, size=32)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["init", "shapes", "--model", REPO, "-o", "c.yaml", "--no-estimate"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["model"] == {"family": "sd", "path": REPO}
    with pytest.raises(ConfigError, match="holds a sd model"):
        resolve_model(REPO, family="flux")


def test_only_the_files_a_load_reads_are_downloaded():
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"], "tokenizer": ["transformers", "CLIPTokenizer"],
             "feature_extractor": [None, None]}
    files = ["model_index.json", "flux1-dev.safetensors", "README.md", "transformer/config.json",
             "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
             "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
             "vae/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.bin",
             "vae/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.msgpack",
             "tokenizer/vocab.json", "tokenizer/pytorch_model.bin", "feature_extractor/preprocessor_config.json"]
    assert hub.download_files(index, files) == [
        "model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00003.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors", "tokenizer/vocab.json", "tokenizer/pytorch_model.bin"]
    # model.weight_variant: that variant's weight files (shards and index included) instead of the plain ones
    files += ["transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
              "transformer/diffusion_pytorch_model.safetensors.index.fp16.json"]
    assert hub.download_files(index, files, "fp16") == [
        "model_index.json", "transformer/config.json", "vae/config.json", "vae/diffusion_pytorch_model.fp16.safetensors",
        "tokenizer/vocab.json", "tokenizer/pytorch_model.bin",
        "transformer/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.fp16.json"]


def test_snakemake_schema_defaults_leave_an_id_alone(hub_cache):
    """Snakemake fills the schema's defaults into the config before diffpipe reads it: a path given alone must
    still mean that model (no filled-in `flavor: tiny`, no filled-in `family: sd` to contradict it)."""
    from snakemake.utils import validate

    from diffpipe.paths import SCHEMA_FILE

    config = {"model": {"path": REPO}, "datasets": [{"name": "d", "path": "x"}]}
    validate(config, str(SCHEMA_FILE))
    model = parse_config(config).model
    assert (model.flavor, model.family, model.path) == ("local", "sd", REPO)
    config = {"datasets": [{"name": "d", "path": "x"}]}
    validate(config, str(SCHEMA_FILE))
    assert (parse_config(config).model.flavor, parse_config(config).model.family) == ("tiny", "sd")


def test_doctor_names_the_snapshot(hub_cache):
    from diffpipe.doctor import _model_checks

    (check,) = _model_checks(parse_config({"model": {"path": REPO}, "datasets": [{"name": "d", "path": "x"}]}))
    assert check.ok and REV_A in check.line() and "revision main" in check.line()


def test_weight_variant_loads_and_keys_the_variant_files(tmp_path, monkeypatch):
    """model.weight_variant: a folder saved with only `fp16` weight files loads from them, its cache keys come
    from them, and without the option the same folder has no plain weights to read (a clear error)."""
    import torch

    monkeypatch.setenv("DIFFPIPE_CACHE", str(tmp_path / "store"))
    tiny = get_family(ModelConfig(family="sd", flavor="tiny"))
    pipe = tiny.load_pipeline()
    pipe.save_pretrained(tmp_path / "m", variant="fp16")
    assert not list((tmp_path / "m" / "unet").glob("diffusion_pytorch_model.safetensors"))
    fam = get_family(ModelConfig(family="sd", flavor="local", path=str(tmp_path / "m"), weight_variant="fp16"))
    unet = fam.load_denoiser()
    for name, t in pipe.unet.state_dict().items():
        torch.testing.assert_close(unet.state_dict()[name], t, rtol=0, atol=0, msg=name)
    assert fam.vae_identity() and fam.text_identity()
    (tmp_path / "m2").mkdir()
    pipe.save_pretrained(tmp_path / "m2")  # the same weights as plain files: the same cache keys
    plain = get_family(ModelConfig(family="sd", flavor="local", path=str(tmp_path / "m2")))
    assert plain.vae_identity() == fam.vae_identity() and plain.text_identity() == fam.text_identity()
    with pytest.raises((OSError, FileNotFoundError)):
        get_family(ModelConfig(family="sd", flavor="local", path=str(tmp_path / "m"))).vae_identity()


@pytest.mark.parametrize(("text", "says"), [("[1, 2]", r"holds no JSON object \(a list\)"),
                                             ("{broken", "cannot be read as JSON")])
def test_a_model_index_that_is_no_json_object_is_an_error_naming_the_file(tmp_path, text, says):
    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"model.path 'm': .*model_index.json {says}.*not a diffusers model index"):
        hub.check_complete(tmp_path, "m")
