"""Dataset files: every format read to the same rows, files chosen by split as the hub does, split slices,
data_files, subsets, and hub dataset repos in parquet."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv
import pyarrow.ipc
import pyarrow.parquet
import pytest
from fake_hub import FakeHub, FakeRepo, use_fake_hub
from test_data import DEMO_MODEL

from qlora_cli.config.schema import DatasetConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.data.examples import load_examples, local_dataset, unread_text
from qlora_cli.data.files import files_for_split, parse_split, read_rows, read_split, unread_files
from qlora_cli.sources.tokenizer import ChatTokenizer

ROWS = [
    {"instruction": f"Say {word}.", "input": "" if n % 2 else "politely", "output": word.upper()}
    for n, word in enumerate(["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"])
]


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_folder(DEMO_MODEL)


def write(path, rows, how):
    """Write rows in one of the formats datasets and users write them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    if how == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif how == "json-list":
        path.write_text(json.dumps(rows, indent=1))
    elif how == "json-lines":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif how == "parquet":
        pyarrow.parquet.write_table(table, path)
    elif how == "csv":
        pyarrow.csv.write_csv(table, path)
    elif how in ("arrow-file", "arrow-stream"):
        open_writer = pyarrow.ipc.new_file if how == "arrow-file" else pyarrow.ipc.new_stream
        with pa.OSFile(str(path), "wb") as sink, open_writer(sink, table.schema) as writer:
            writer.write_table(table)
    return path


FORMATS = {
    "jsonl": "rows.jsonl",
    "json-list": "rows.json",
    "json-lines": "rows.json",
    "parquet": "rows.parquet",
    "csv": "rows.csv",
    "arrow-file": "rows.arrow",
    "arrow-stream": "rows.arrow",
}


@pytest.mark.parametrize("how", list(FORMATS))
def test_each_format_reads_the_same_rows_and_examples(tok, tmp_path, how):
    path = write(tmp_path / FORMATS[how], ROWS, how)
    assert [row for _, row in read_rows(path)] == ROWS
    reference = load_examples(DatasetConfig(path=str(write(tmp_path / "ref.jsonl", ROWS, "jsonl"))), tok, 256)
    examples = load_examples(DatasetConfig(path=str(path)), tok, 256)
    assert [e.input_ids for e in examples] == [e.input_ids for e in reference]
    assert [e.labels for e in examples] == [e.labels for e in reference]


def test_csv_cells_stay_text(tmp_path):
    path = tmp_path / "n.csv"
    path.write_text("instruction,input,output\nHalf of 7?,,3.50\nDouble 0012?,x,0024\n")
    rows = [row for _, row in read_rows(path)]
    assert rows == [
        {"instruction": "Half of 7?", "input": "", "output": "3.50"},
        {"instruction": "Double 0012?", "input": "x", "output": "0024"},
    ]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "items.json", "rows.jsonl.gz", "items.json.gz"])
def test_a_byte_order_mark_is_skipped(tmp_path, name):
    """Windows editors start a UTF-8 file with a BOM; `datasets` reads such JSON, and so does qlora."""
    row = {"instruction": "a", "output": "b"}
    text = json.dumps([row]) if name.startswith("items") else json.dumps(row) + "\n"
    data = b"\xef\xbb\xbf" + text.encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert [found for _, found in read_rows(path)] == [row]


def gzipped(path):
    """path.gz holding path's bytes, as `gzip path` leaves it."""
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    return packed


@pytest.mark.parametrize("how", ["jsonl", "json-list", "json-lines", "csv"])
def test_a_gzipped_file_reads_as_its_plain_file(tmp_path, how):
    plain = write(tmp_path / FORMATS[how], ROWS, how)
    packed = gzipped(plain)
    assert [row for _, row in read_rows(packed)] == [row for _, row in read_rows(plain)] == ROWS
    assert all(where.startswith(f"{packed}:") for where, _ in read_rows(packed))


def test_a_gzipped_file_names_its_bad_line(tmp_path):
    plain = tmp_path / "bad.jsonl"
    plain.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(QLoraError, match=r"bad\.jsonl\.gz:2: not valid JSON \(Expecting value: column 10\)$"):
        list(read_rows(gzipped(plain)))


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.csv.gz"])
def test_a_corrupt_or_cut_short_gz_is_one_line_naming_it(tmp_path, name):
    whole = gzip.compress("".join(json.dumps(row) + "\n" for row in ROWS * 50).encode())
    path = tmp_path / name
    for data, reason in [
        (whole[: len(whole) // 2], "Compressed file ended before the end-of-stream marker was reached"),
        (b'{"text": "a"}\n', "Not a gzipped file"),
    ]:
        path.write_bytes(data)
        with pytest.raises(QLoraError, match=rf"^{path}: cannot read as gzip \({reason}"):
            list(read_rows(path))


def test_where_names_file_and_row(tok, tmp_path):
    path = write(tmp_path / "rows.parquet", [{"text": "a"}, {"body": "b"}], "parquet")
    with pytest.raises(QLoraError, match=r"rows\.parquet: row 1: field 'text' must be a string, got null"):
        load_examples(DatasetConfig(path=str(path), type="text"), tok, 64)


def test_unreadable_files_are_one_line_errors(tok, tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(QLoraError, match=r"broken\.parquet: cannot read as parquet"):
        load_examples(DatasetConfig(path=str(broken)), tok, 64)
    lines = tmp_path / "bad.json"
    lines.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(QLoraError, match=r"bad\.json:2: not valid JSON \(Expecting value: column 10\)$"):
        load_examples(DatasetConfig(path=str(lines), type="text"), tok, 64)
    lines.write_text('[{"text": "a"},\n{"text": "b}]')
    with pytest.raises(
        QLoraError, match=r"bad\.json:2: not valid JSON \(Unterminated string starting at: column 10\)$"
    ):
        load_examples(DatasetConfig(path=str(lines), type="text"), tok, 64)
    no_suffix = write(tmp_path / "rows.data", ROWS, "parquet")
    with pytest.raises(QLoraError, match=r"unsupported dataset file type '\.data'"):
        load_examples(DatasetConfig(path=str(no_suffix)), tok, 64)
    assert len(load_examples(DatasetConfig(path=str(no_suffix), ds_type="parquet"), tok, 256)) == len(ROWS)


def test_a_json_file_of_one_object_over_several_lines_says_so(tmp_path):
    """Valid JSON, but neither a list of rows nor JSON Lines: the line says that, not that line 1 is invalid."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(QLoraError, match=r"rows\.json: one JSON object over \d+ lines, not rows; write "):
        list(read_rows(path))
    path.write_text(json.dumps(ROWS[0]))  # on one line it is JSON Lines of one row, as `datasets` reads it
    assert [row for _, row in read_rows(path)] == [ROWS[0]]


# ----- splits -----


def words(rows):
    return [row["output"] for _, row in rows]


ALL = [r["output"] for r in ROWS]


@pytest.mark.parametrize(
    "split, expected",
    [
        ("train", ALL),
        ("train[:20%]", ALL[:2]),
        ("train[10%:30%]", ALL[1:3]),
        ("train[-30%:]", ALL[7:]),
        ("train[2:5]", ALL[2:5]),
        ("train[:3]", ALL[:3]),
        ("train[-2:]", ALL[-2:]),
        ("train[4]", [ALL[4]]),
        ("train[:2]+train[-1:]", ALL[:2] + ALL[-1:]),
        ("train[50:]", []),
    ],
)
def test_split_slices(tmp_path, split, expected):
    path = write(tmp_path / "rows.jsonl", ROWS, "jsonl")
    assert words(read_split(path, split)) == expected


@pytest.mark.parametrize(
    "split, message",
    [
        ("train[:x%]", r"'x%' is not a row index or a percent"),
        ("train[]", "empty brackets"),
        ("train(1)", "is not a split expression"),
        ("train[40]", r"row 40 is out of range \(10 rows\)"),
        ("test", "is one file, which is the split 'train'; it has no split 'test'"),
    ],
)
def test_bad_splits_are_refused(tmp_path, split, message):
    path = write(tmp_path / "rows.jsonl", ROWS, "jsonl")
    with pytest.raises(QLoraError, match=message):
        read_split(path, split)


def test_parse_split_keeps_bounds_as_written():
    assert [p.text for p in parse_split("train[:20%] + test[3:]")] == ["train[:20%]", "test[3:]"]


def test_folder_trains_only_on_the_asked_split(tmp_path):
    folder = tmp_path / "repo"
    write(folder / "data" / "train-00000-of-00002.parquet", ROWS[:4], "parquet")
    write(folder / "data" / "train-00001-of-00002.parquet", ROWS[4:8], "parquet")
    write(folder / "data" / "test-00000-of-00001.parquet", ROWS[8:], "parquet")
    assert words(read_split(folder, "train")) == ALL[:8]
    assert words(read_split(folder, "test")) == ALL[8:]
    assert words(read_split(folder, "train[-25%:]")) == ALL[6:8]
    assert words(read_split(folder, "train+test")) == ALL
    with pytest.raises(QLoraError, match=r"has no split 'validation' \(its splits: test, train\)"):
        read_split(folder, "validation")


def test_split_keywords_and_custom_split_names(tmp_path):
    folder = tmp_path / "named"
    write(folder / "training.jsonl", ROWS[:3], "jsonl")
    write(folder / "dev.jsonl", ROWS[3:5], "jsonl")
    write(folder / "eval" / "part.jsonl", ROWS[5:6], "jsonl")
    assert words(read_split(folder, "train")) == ALL[:3]
    assert words(read_split(folder, "validation")) == ALL[3:5]
    assert words(read_split(folder, "test")) == ALL[5:6]
    custom = tmp_path / "custom"
    write(custom / "data" / "train_sft-00000-of-00001.parquet", ROWS[:2], "parquet")
    write(custom / "data" / "test_sft-00000-of-00001.parquet", ROWS[2:3], "parquet")
    assert words(read_split(custom, "train_sft")) == ALL[:2]
    assert words(read_split(custom, "test_sft")) == ALL[2:3]


def test_save_to_disk_folders_skip_their_metadata(tmp_path):
    folder = tmp_path / "saved"
    write(folder / "train" / "data-00000-of-00001.arrow", ROWS[:6], "arrow-stream")
    write(folder / "test" / "data-00000-of-00001.arrow", ROWS[6:], "arrow-stream")
    for name in ("train/state.json", "train/dataset_info.json", "test/state.json", "dataset_dict.json"):
        (folder / name).write_text('{"_data_files": []}')
    assert words(read_split(folder, "train")) == ALL[:6]
    assert words(read_split(folder, "test")) == ALL[6:]


def test_a_folder_reads_its_gz_files_by_split(tmp_path):
    folder = tmp_path / "repo"
    for name, rows, how in [
        ("train_sft-00000-of-00002.jsonl", ROWS[:3], "jsonl"),
        ("train_sft-00001-of-00002.csv", ROWS[3:6], "csv"),
    ]:
        plain = write(folder / "data" / name, rows, how)
        gzipped(plain)
        plain.unlink()
    write(folder / "data" / "test_sft-00000-of-00001.json", ROWS[6:], "json-list")
    assert words(read_split(folder, "train_sft")) == ALL[:6]
    assert words(read_split(folder, "test_sft")) == ALL[6:]


def test_a_folder_names_the_files_it_does_not_read(tmp_path):
    """A file in no format qlora reads trains nothing, and a note says so; hidden files, special
    folders, the metadata `datasets` writes and a hub repo's README.md are not rows, and go without one."""
    folder = tmp_path / "repo"
    write(folder / "train.jsonl", ROWS, "jsonl")
    for name in ("notes.txt", "more/rows.tsv", "rows.parquet.gz", "README.md", ".gitattributes"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("a\tb\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "prepare.cpython-311.pyc").write_text("")
    (folder / "__pycache__" / "rows.jsonl").write_text('{"text": "not a row"}\n')
    for name in ("dataset_info.json", "dataset_infos.json", "config.json"):
        (folder / name).write_text('{"default": {"description": "not a row"}}')
    assert words(read_split(folder, "train")) == ALL
    assert unread_files(folder) == ["more/rows.tsv", "notes.txt", "rows.parquet.gz"]
    assert unread_files(folder, data_files="train.jsonl") == []
    assert unread_files(folder / "train.jsonl") == []
    assert unread_text(["a.txt"]) == "1 file not read, in no format qlora reads: a.txt"
    many = [f"{n}.png" for n in range(8)]
    assert (
        unread_text(many)
        == "8 files not read, in no format qlora reads: 0.png, 1.png, 2.png, 3.png, 4.png and 3 more"
    )


def test_a_folder_without_split_names_is_train(tmp_path):
    folder = tmp_path / "plain"
    write(folder / "b.jsonl", ROWS[5:], "jsonl")
    write(folder / "a.csv", ROWS[:5], "csv")
    assert words(read_split(folder, "train")) == ALL
    with pytest.raises(QLoraError, match=r"no split 'test' \(its splits: train\)"):
        read_split(folder, "test")


def test_data_files_and_subsets(tmp_path):
    folder = tmp_path / "repo"
    write(folder / "main" / "train.jsonl", ROWS[:4], "jsonl")
    write(folder / "main" / "test.jsonl", ROWS[4:6], "jsonl")
    write(folder / "extra" / "train.jsonl", ROWS[6:], "jsonl")
    (folder / "__pycache__").mkdir()
    assert words(read_split(folder, "train", subset="extra")) == ALL[6:]
    assert words(read_split(folder, "test", subset="main")) == ALL[4:6]
    with pytest.raises(QLoraError, match=r"no subset 'other' \(its folders: extra, main\)"):
        read_split(folder, "train", subset="other")
    assert words(read_split(folder, "train", data_files="extra/train.jsonl")) == ALL[6:]
    assert words(read_split(folder, "train[:1]", data_files=["main/test.jsonl", "extra/*.jsonl"])) == ALL[4:5]
    by_split = {"train": "main/train.jsonl", "validation": ["main/test.jsonl"]}
    assert words(read_split(folder, "validation", data_files=by_split)) == ALL[4:6]
    with pytest.raises(QLoraError, match="data_files 'nothing/\\*.jsonl' matches no file"):
        read_split(folder, "train", data_files="nothing/*.jsonl")
    with pytest.raises(QLoraError, match=r"split 'test' is not in data_files \(it names train, validation\)"):
        read_split(folder, "test", data_files=by_split)


# ----- hub dataset repos -----


def parquet_bytes(rows):
    sink = pa.BufferOutputStream()
    pyarrow.parquet.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def test_hub_parquet_repo_reads_the_asked_split(tok, monkeypatch, tmp_path):
    files = {
        "data/train-00000-of-00001.parquet": parquet_bytes(ROWS[:7]),
        "data/test-00000-of-00001.parquet": parquet_bytes(ROWS[7:]),
        "README.md": b"# rows",
    }
    with FakeHub({"org/rows": FakeRepo({"main": files}, repo_type="dataset")}) as hub:
        use_fake_hub(monkeypatch, hub, tmp_path / "hf_home")
        train = local_dataset(DatasetConfig(path="org/rows", split="train[:50%]"))
        assert hub.fetched_files("org/rows") == {"data/train-00000-of-00001.parquet"}
        test = local_dataset(DatasetConfig(path="org/rows", split="test"))
        assert hub.fetched_files("org/rows") == {
            f"data/{split}-00000-of-00001.parquet" for split in ("train", "test")
        }
        hub.clear_requests()
        with pytest.raises(QLoraError, match=r"has no split 'validation' \(its splits: test, train\)"):
            load_examples(local_dataset(DatasetConfig(path="org/rows", split="validation")), tok, 256)
    assert train.path != "org/rows"
    assert len(load_examples(train, tok, 256)) == 4  # 50% of 7 rows, rounded to the closest
    examples = load_examples(test, tok, 256)
    reference = load_examples(
        DatasetConfig(path=str(write(tmp_path / "t.jsonl", ROWS[7:], "jsonl"))), tok, 256
    )
    assert [e.input_ids for e in examples] == [e.input_ids for e in reference]


def test_shards_take_contiguous_parts(tok, tmp_path):
    path = write(tmp_path / "rows.jsonl", ROWS, "jsonl")
    parts = [
        [
            tok.decode(e.input_ids)
            for e in load_examples(DatasetConfig(path=str(path), shards=3, shards_idx=i), tok, 256)
        ]
        for i in range(3)
    ]
    every = [tok.decode(e.input_ids) for e in load_examples(DatasetConfig(path=str(path)), tok, 256)]
    assert [len(p) for p in parts] == [4, 3, 3] and parts[0] + parts[1] + parts[2] == every


def test_builder_name_paths_read_data_files_from_the_working_directory(tok, tmp_path, monkeypatch):
    write(tmp_path / "data" / "rows.parquet", ROWS[:3], "parquet")
    absolute = write(tmp_path / "elsewhere" / "rows.jsonl", ROWS[3:5], "jsonl")
    monkeypatch.chdir(tmp_path)
    relative = local_dataset(DatasetConfig(path="parquet", data_files="data/*.parquet"))
    assert words(read_split(Path(relative.path), "train", data_files=relative.data_files)) == ALL[:3]
    assert len(load_examples(relative, tok, 256)) == 3
    by_absolute = local_dataset(DatasetConfig(path="json", data_files=[str(absolute)]))
    assert len(load_examples(by_absolute, tok, 256)) == 2


def test_files_for_split_picks_the_split_expressions_files():
    names = [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test-00000-of-00001.parquet",
    ]
    assert files_for_split(names, "train[:10%]") == names[:2]
    assert files_for_split(names, "test+train[-1:]") == [names[2], *names[:2]]
    assert files_for_split(names, "validation") == names
    subsets = ["main/train.jsonl", "main/test.jsonl", "extra/train.jsonl", "extra/dataset_info.json"]
    assert files_for_split(subsets, "train", subset="extra") == ["extra/train.jsonl"]
