"""Build hook: the wheel carries the Ansible collection as package data, so an installed p40fleet provisions.

build_py copies the files of the collection p40fleet.fleet (site.yml, ansible.cfg, roles/, playbooks/, ...:
what `ansible-galaxy collection build` would pack, python/p40fleet/collection.py decides) into
p40fleet/collection/ansible_collections/p40fleet/fleet/ of the build: p40fleet/collection/ is then a collections
path, where the roles' full names (p40fleet.fleet.<plugin>) resolve. An editable install needs no copy: p40fleet finds the checkout itself.
The version's one home is galaxy.yml.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _collection_module():
    spec = importlib.util.spec_from_file_location("p40fleet_collection", ROOT / "python" / "p40fleet" / "collection.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COLLECTION = _collection_module()


class BuildPyWithCollection(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        top = Path(self.build_lib) / "p40fleet" / "collection"
        if top.exists():
            shutil.rmtree(top)
        target = top / "ansible_collections" / "p40fleet" / "fleet"
        for rel in COLLECTION.collection_files(ROOT):
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest)


setup(
    version=COLLECTION.galaxy_metadata(ROOT)["version"],
    cmdclass={"build_py": BuildPyWithCollection},
)
