"""training_data's worker, run by the env's python as the env owner. Prints one JSON document.

usage: training_data_tool.py probe|dataset|model SPEC_JSON

probe    reads the markers and files, changes nothing: {"dataset": {"ok": bool, "why": str}, "model": {...}}
dataset  copies GSM8K's parquet files from a local path into raw_dir (unless they are there: the hub's and the
         controller's are) and converts them to train.parquet / test.parquet exactly as verl's
         examples/data_preprocess/gsm8k.py does
model    copies the model from a local path (unless it is in place) and verifies what a load needs

No network and no token here: root's throwaway account downloads the hub's files and root checks them before the
owner copies them in (roles/training_data/tasks/hub.yml).
"""

import json
import os
import pathlib
import re
import shutil
import struct
import sys

# owner_script helpers: sha256() and read_json() are plugins/module_utils/owner_script.py's, put before this text
# by the owner_script lookup (plugins/lookup/owner_script.py).

SPLITS = ("train", "test")
# Bump when the conversion's output changes, so converted sets are rebuilt once.
CONVERTER_VERSION = 1
DATA_SOURCE = "openai/gsm8k"
# verl examples/data_preprocess/gsm8k.py (volcengine/verl): the instruction appended to each question.
INSTRUCTION_FOLLOWING = 'Let\'s think step by step and output the final answer after "####".'
TOKENIZER_FILES = ("tokenizer_config.json",)
TOKENIZER_ANY_OF = (("tokenizer.json",), ("vocab.json", "merges.txt"))


# --- GSM8K -------------------------------------------------------------------------------------
def extract_solution(answer):
    """The number after '####' with its commas removed, as verl's gsm8k.py extract_solution does."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in answer: {answer[-80:]!r}")
    return found.group(0).split("#### ")[1].replace(",", "")


def convert_row(split, index, question_raw, answer_raw):
    """One row in verl's GSM8K layout (examples/data_preprocess/gsm8k.py, make_map_fn.process_fn)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION_FOLLOWING}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_solution(answer_raw)},
        "extra_info": {"split": split, "index": index, "answer": answer_raw, "question": question_raw},
    }


def convert_split(source, dest, split):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(source)
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise ValueError(f"{source} lacks column(s) {sorted(missing)} (found {table.column_names})")
    questions = table.column("question").to_pylist()
    answers = table.column("answer").to_pylist()
    rows = [convert_row(split, i, q, a) for i, (q, a) in enumerate(zip(questions, answers))]  # noqa: B905
    tmp = dest.with_name(dest.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, dest)
    return len(rows)


def source_files(spec):
    raw = pathlib.Path(spec["raw_dir"])
    return {split: raw / spec["dataset_files"][split] for split in SPLITS}


def dataset_marker(spec):
    return pathlib.Path(spec["data_dir"]) / ".p40fleet-gsm8k.json"


def dataset_state(spec):
    marker = read_json(dataset_marker(spec))
    if not marker:
        return False, "no conversion record"
    if marker.get("converter") != CONVERTER_VERSION or marker.get("source") != spec["dataset_identity"]:
        return False, "the record names another source or converter"
    for split, path in source_files(spec).items():
        if not path.is_file() or sha256(path) != marker["sources"].get(split):
            return False, f"source {path} differs from the one converted"
        out = pathlib.Path(spec["data_dir"]) / f"{split}.parquet"
        if not out.is_file() or sha256(out) != marker["outputs"].get(split):
            return False, f"{out} is missing or differs from the converted set"
    return True, "converted set matches its source"


def fetch_dataset(spec):
    raw = pathlib.Path(spec["raw_dir"])
    raw.mkdir(parents=True, exist_ok=True)
    local = pathlib.Path(spec["dataset_local_path"])
    for split in SPLITS:
        target = raw / spec["dataset_files"][split]
        if target.resolve() == (local / spec["dataset_files"][split]).resolve():
            continue  # the hub's or the controller's files are already in place
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local / spec["dataset_files"][split], target)


def dataset(spec):
    fetch_dataset(spec)
    data_dir = pathlib.Path(spec["data_dir"])
    data_dir.mkdir(parents=True, exist_ok=True)
    counts, sources, outputs = {}, {}, {}
    for split, path in source_files(spec).items():
        out = data_dir / f"{split}.parquet"
        counts[split] = convert_split(path, out, split)
        sources[split] = sha256(path)
        outputs[split] = sha256(out)
    record = {
        "converter": CONVERTER_VERSION,
        "source": spec["dataset_identity"],
        "sources": sources,
        "outputs": outputs,
        "rows": counts,
    }
    dataset_marker(spec).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return {"rows": counts, "outputs": outputs}


# --- The model ---------------------------------------------------------------------------------
def safetensors_header(path):
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 1024 * 1024:
            raise ValueError(f"{path}: header length {length} is not plausible")
        header = json.loads(handle.read(length))
    size = os.path.getsize(path)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if 8 + length + end > size:
            raise ValueError(f"{path}: tensor {name} ends past the file ({size} bytes): truncated download?")
    return len(header) - ("__metadata__" in header)


def verify_model(model_dir):
    model_dir = pathlib.Path(model_dir)
    problems = []
    config = read_json(model_dir / "config.json")
    if not isinstance(config, dict) or "model_type" not in config:
        problems.append("config.json is missing, unparsable or has no model_type")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        problems.append("no *.safetensors weights")
    tensors = 0
    for path in weights:
        try:
            tensors += safetensors_header(path)
        except (OSError, ValueError, KeyError) as error:
            problems.append(str(error))
    index = read_json(model_dir / "model.safetensors.index.json")
    if index:
        wanted = set(index.get("weight_map", {}).values())
        absent = sorted(w for w in wanted if not (model_dir / w).is_file())
        if absent:
            problems.append(f"weight files named by the index are missing: {absent}")
    for name in TOKENIZER_FILES:
        if not (model_dir / name).is_file():
            problems.append(f"tokenizer file {name} is missing")
    if not any(all((model_dir / n).is_file() for n in group) for group in TOKENIZER_ANY_OF):
        problems.append("neither tokenizer.json nor vocab.json + merges.txt is present")
    return {"problems": problems, "tensors": tensors, "model_type": (config or {}).get("model_type", "")}


def model_marker(spec):
    return pathlib.Path(spec["model_dir"]) / ".p40fleet-model.json"


def model_state(spec):
    marker = read_json(model_marker(spec))
    if not marker or marker.get("source") != spec["model_identity"]:
        return False, "no download record for this model and revision"
    verified = verify_model(spec["model_dir"])
    if verified["problems"]:
        return False, "; ".join(verified["problems"])
    return True, "model matches its record and verifies"


def model(spec):
    model_dir = pathlib.Path(spec["model_dir"])
    model_dir.mkdir(parents=True, exist_ok=True)
    if pathlib.Path(spec["model_local_path"]).resolve() != model_dir.resolve():
        shutil.copytree(spec["model_local_path"], model_dir, dirs_exist_ok=True)
    verified = verify_model(model_dir)
    if verified["problems"]:
        raise ValueError(f"the model in {model_dir} cannot be loaded: " + "; ".join(verified["problems"]))
    model_marker(spec).write_text(json.dumps({"source": spec["model_identity"], **verified}, indent=2) + "\n")
    return verified


def main(argv):
    action, spec = argv[1], json.loads(argv[2])
    if action == "probe":
        data_ok, data_why = dataset_state(spec)
        model_ok, model_why = model_state(spec)
        result = {"dataset": {"ok": data_ok, "why": data_why}, "model": {"ok": model_ok, "why": model_why}}
    elif action == "dataset":
        result = dataset(spec)
    elif action == "model":
        result = model(spec)
    else:
        raise SystemExit(f"unknown action {action}")
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
