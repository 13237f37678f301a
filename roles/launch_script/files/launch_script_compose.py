"""Compose verl's PPO config with the launch overrides, the way `main_ppo` would, without importing torch.

Run by the launch script's --dry-run with the env's python (as the env owner), and by the tests against
the Hydra configs of verl's PyPI wheels. Prints the composed config; exits 1 naming every override that
verl's config does not have. An override that creates a key (`+key=` or `++key=` on a missing key) passes
only when the key is in --added-key: keys verl reads with `.get()` (the role's vars/main.yml cites where).

usage: launch_script_compose.py [--config-dir DIR] [--added-key KEY]... [--quiet] -- OVERRIDE...
"""

import argparse
import importlib.util
import pathlib
import sys


def verl_config_dir():
    # find_spec on a top-level package locates it without running its __init__ (which imports torch).
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("launch_script_compose: verl is not installed in this python (" + sys.executable + ")")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


def override_key(override):
    key = override.split("=", 1)[0]
    return key.lstrip("+~"), key[: len(key) - len(key.lstrip("+~"))]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", type=pathlib.Path)
    parser.add_argument("--config-name", default="ppo_trainer")
    parser.add_argument("--added-key", action="append", default=[])
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    config_dir = (args.config_dir or verl_config_dir()).resolve()
    if not (config_dir / f"{args.config_name}.yaml").is_file():
        raise SystemExit(f"launch_script_compose: no {args.config_name}.yaml in {config_dir}")
    problems = []
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        base = compose(config_name=args.config_name)
        for override in args.overrides:
            key, prefix = override_key(override)
            if key.startswith("hydra."):
                continue
            if prefix and OmegaConf.select(base, key, default=KeyError) is KeyError and key not in args.added_key:
                problems.append(f"{override}: verl's {args.config_name} has no {key}, and verl is not known to read it")
        try:
            cfg = compose(config_name=args.config_name, overrides=args.overrides)
        except HydraException as error:
            problems.append(str(error).strip())
            cfg = None
    if "torch" in sys.modules:
        problems.append("composing the config imported torch (it must not: --dry-run stays cheap)")
    if problems:
        print(f"launch_script_compose: {len(problems)} override(s) rejected against {config_dir}:", file=sys.stderr)
        for problem in problems:
            print("  - " + problem, file=sys.stderr)
        return 1
    if not args.quiet:
        print(OmegaConf.to_yaml(cfg))
    print(f"launch_script_compose: {len(args.overrides)} override(s) compose against {config_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
