"""p40fleet verl post-install checks (run by the env's python as the env owner). Prints JSON {check: error|""}.

argv[1]: JSON {"checks": [...], "source": DIR, "version": "0.4.1", "overrides": [...]}
"""

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

spec = json.loads(sys.argv[1])
source = pathlib.Path(spec["source"])
results = {}


def editable():
    found = importlib.metadata.distribution("verl")
    direct = json.loads(found.read_text("direct_url.json") or "{}")
    origin = importlib.util.find_spec("verl").origin
    problems = []
    if found.version != spec["version"]:
        problems.append(f"verl {found.version} installed, {spec['version']} required")
    if not direct.get("dir_info", {}).get("editable"):
        problems.append("verl is not an editable install")
    if direct.get("url") != source.as_uri():
        problems.append(f"verl is installed from {direct.get('url')}, not {source.as_uri()}")
    if not origin or not pathlib.Path(origin).resolve().is_relative_to(source.resolve()):
        problems.append(f"`import verl` would load {origin}, not the checkout {source}")
    return "; ".join(problems)


def compile_all():
    bad = []
    for path in sorted((source / "verl").rglob("*.py")):
        try:
            compile(path.read_bytes(), str(path), "exec")
        except SyntaxError as error:
            bad.append(f"{path.relative_to(source)}:{error.lineno}: {error.msg}")
    return "; ".join(bad[:10])


def hydra_compose():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = source / "verl" / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=spec["overrides"])
    for override in spec["overrides"]:
        key, value = override.lstrip("+").split("=", 1)
        if str(OmegaConf.select(cfg, key)) != value:
            return f"{key} composed as {OmegaConf.select(cfg, key)!r}, expected {value}"
    return ""


def flash_attn_shim():
    from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input  # noqa: F401

    return ""


def import_verl():
    import verl

    return "" if verl.__version__ == spec["version"] else f"verl.__version__ is {verl.__version__}"


def pip_check():
    """The whole env, verl's locked dependencies and the pytorch role's builds together: no broken requirement."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False, cwd=source
    )
    return "" if done.returncode == 0 else f"pip check: {(done.stdout + done.stderr).strip()[-800:]}"


def cfg_job():
    done = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", "--cfg", "job", *spec["overrides"]],
        capture_output=True,
        text=True,
        check=False,
        cwd=os.environ.get("TMPDIR", "/tmp"),
    )
    if done.returncode != 0:
        return f"main_ppo --cfg job exited {done.returncode}: {done.stderr.strip()[-800:]}"
    return "" if "actor_rollout_ref" in done.stdout else "main_ppo --cfg job printed no config"


CHECKS = {
    "editable": editable,
    "compile": compile_all,
    "hydra_compose": hydra_compose,
    "flash_attn_shim": flash_attn_shim,
    "pip_check": pip_check,
    "import": import_verl,
    "cfg_job": cfg_job,
}
for name in spec["checks"]:
    try:
        results[name] = CHECKS[name]()
    except Exception as error:  # every failure is reported as data, by check
        results[name] = f"{type(error).__name__}: {error}"
print(json.dumps(results))
