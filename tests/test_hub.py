"""hotcold.hub and the commands that use it (pull, list, rm, run, -m ORG/REPO), against a local stand-in for
the Hub's HTTP API (tests/hub_stand_in.py) selected through HF_ENDPOINT: never the real Hub."""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
import torch

from hotcold import hub
from hotcold.cli import main
from tests.hub_stand_in import HubStandIn, Repo

DEMO = Path(hub.__file__).parent / "data"


# ---------------------------------------------------------------------------------------------------
# names and file choice: pure


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Qwen/Qwen3-8B-GGUF", hub.ModelName("Qwen/Qwen3-8B-GGUF")),
        ("Qwen/Qwen3-8B-GGUF:q4_k_m", hub.ModelName("Qwen/Qwen3-8B-GGUF", "q4_k_m")),
        (
            "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q8_0",
            hub.ModelName("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q8_0"),
        ),
        ("https://huggingface.co/org/repo", hub.ModelName("org/repo")),
        ("models/llama.gguf", None),  # a path, even when it does not exist
        ("./org/repo", None),
        ("/abs/org/repo", None),
        ("just-a-name", None),
    ],
)
def test_parse_name(text, expected):
    assert hub.parse_name(text) == expected


def test_an_existing_folder_is_a_path_not_a_name(tmp_path, monkeypatch):
    (tmp_path / "org" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse_name("org/repo") is None


def test_a_bad_hub_name_is_refused():
    with pytest.raises(hub.HubError, match="expected hf.co/ORG/REPO"):
        hub.parse_name("hf.co/only-one-part")


REPO_FILES = [
    "README.md",
    "Model-F16.gguf",
    "Model-Q8_0.gguf",
    "Model-Q4_K_M.gguf",
    "mmproj-Model-Q4_K_M.gguf",
    "Model-Q4_K_M.imatrix.gguf",
    "big/Model-Q6_K-00001-of-00003.gguf",
    "big/Model-Q6_K-00002-of-00003.gguf",
    "big/Model-Q6_K-00003-of-00003.gguf",
]


def test_default_choice_is_q4_k_m_then_q8_0_then_the_first_model():
    assert hub.choose_files(REPO_FILES, None).model_files == ("Model-Q4_K_M.gguf",)
    no_q4 = [p for p in REPO_FILES if "Q4_K_M" not in p]
    assert hub.choose_files(no_q4, None).primary == "Model-Q8_0.gguf"
    only = ["mmproj-x.gguf", "x.imatrix.gguf", "Model-F16.gguf"]
    assert hub.choose_files(only, None).primary == "Model-F16.gguf"  # mmproj / imatrix never chosen


def test_tag_matches_case_insensitively_and_brings_every_split_part():
    assert hub.choose_files(REPO_FILES, "q8_0").primary == "Model-Q8_0.gguf"
    plan = hub.choose_files(REPO_FILES, "Q6_K")
    assert plan.model_files == tuple(f"big/Model-Q6_K-0000{i}-of-00003.gguf" for i in (1, 2, 3))


def test_a_missing_split_part_is_named():
    files = ["Model-Q6_K-00001-of-00002.gguf"]
    with pytest.raises(hub.HubError, match=r"part 1 of 2, but part\(s\) \[2\]"):
        hub.choose_files(files, "Q6_K", "org/repo")


def test_unknown_tag_lists_the_tags_that_exist():
    with pytest.raises(hub.HubError) as err:
        hub.choose_files(REPO_FILES, "Q3_K_S", "org/repo")
    assert "no file tagged 'Q3_K_S'" in str(err.value)
    assert "F16, Q4_K_M, Q6_K, Q8_0" in str(err.value)


def test_no_gguf_is_an_error():
    with pytest.raises(hub.HubError, match="org/repo has no GGUF model file"):
        hub.choose_files(["README.md", "model.safetensors"], None, "org/repo")


def test_powerinfer_repo_prefers_the_powerinfer_file_with_its_statistics():
    files = [
        "llama-7b-relu.gguf",
        "llama-7b-relu.powerinfer.gguf",
        "llama-7b-relu.q4.powerinfer.gguf",
        "llama-7b-relu.powerinfer.gguf.generated.gpuidx",
        "activation/activation_0.pt",
        "activation/activation_1.pt",
    ]
    plan = hub.choose_files(files, None)
    assert plan.primary == "llama-7b-relu.powerinfer.gguf"
    assert plan.extras == (
        "activation/activation_0.pt",
        "activation/activation_1.pt",
        "llama-7b-relu.powerinfer.gguf.generated.gpuidx",
    )
    assert hub.choose_files(files, "q4").primary == "llama-7b-relu.q4.powerinfer.gguf"
    assert "Q4" in hub.available_tags(files)


# ---------------------------------------------------------------------------------------------------
# against the stand-in Hub


@pytest.fixture
def hub_site(tmp_path, monkeypatch, tiny_dense_gguf):
    """The stand-in Hub with three repositories, and an empty Hugging Face cache under tmp_path."""
    dense = Path(tiny_dense_gguf).read_bytes()
    site = HubStandIn()
    site.repos["org/tiny-GGUF"] = Repo(
        {
            "README.md": b"# tiny",
            "tiny-Q8_0.gguf": dense,
            "tiny-Q4_K_M.gguf": dense,
            "mmproj-tiny-F16.gguf": b"x",
        }
    )
    activation = {f"activation/{p.name}": p.read_bytes() for p in sorted((DEMO / "activation").glob("*.pt"))}
    site.repos["PowerInfer/Demo-PowerInfer-GGUF"] = Repo(
        {
            "demo.gguf": b"GGUF dense original",
            "demo.powerinfer.gguf": (DEMO / "demo.powerinfer.gguf").read_bytes(),
        }
        | activation
    )
    site.repos["org/gated-GGUF"] = Repo({"g-Q4_K_M.gguf": dense}, gated_token="hf_secret")
    site.repos["org/no-gguf"] = Repo({"model.safetensors": b"x", "README.md": b"x"})
    url = site.start()
    for var in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    site.dense = dense
    yield site
    site.stop()


def test_pull_default_file_into_the_standard_cache(hub_site, tmp_path):
    path = hub.pull("org/tiny-GGUF")
    assert path.name == "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == hub_site.dense
    assert str(path).startswith(str(tmp_path / "hf" / "hub" / "models--org--tiny-GGUF" / "snapshots"))
    fetched = {p for m, p, _ in hub_site.requests if m == "GET" and "/resolve/" in p}
    assert fetched == {"/org/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"}  # not the mmproj, not the other quant


def test_pull_by_tag_and_hf_co_prefix(hub_site):
    assert hub.pull("hf.co/org/tiny-GGUF:q8_0").name == "tiny-Q8_0.gguf"


def test_powerinfer_repo_brings_its_activation_folder(hub_site):
    path = hub.pull("PowerInfer/Demo-PowerInfer-GGUF")
    assert path.name == "demo.powerinfer.gguf"
    stats = sorted(p.name for p in (path.parent / "activation").iterdir())
    assert stats == [f"activation_{i}.pt" for i in range(8)]
    assert not (path.parent / "demo.gguf").exists()


def test_offline_reuses_the_cache_with_the_hub_gone(hub_site, monkeypatch):
    first = hub.pull("org/tiny-GGUF")
    hub_site.stop()
    hub_site.requests.clear()
    assert hub.pull("org/tiny-GGUF", offline=True) == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.pull("org/tiny-GGUF") == first
    assert hub_site.requests == []  # no network call at all


def test_offline_and_not_cached(hub_site):
    with pytest.raises(hub.HubError, match="not in the cache .* offline: pull it first"):
        hub.pull("org/tiny-GGUF:Q8_0", offline=True)


def test_unreachable_hub_falls_back_to_the_cache(hub_site, monkeypatch, capsys):
    first = hub.pull("org/tiny-GGUF")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert hub.pull("org/tiny-GGUF") == first
    assert "unreachable" in capsys.readouterr().err
    with pytest.raises(hub.HubError, match="cannot reach .* not cached"):
        hub.pull("org/other-GGUF")


@pytest.mark.parametrize(
    "name, message",
    [
        ("org/missing", "no model repository org/missing on http://127.0.0.1"),
        ("org/no-gguf", "org/no-gguf has no GGUF model file"),
        ("org/tiny-GGUF:IQ2_XS", "no file tagged 'IQ2_XS'; its tags: Q4_K_M, Q8_0"),
        ("org/gated-GGUF", "org/gated-GGUF is gated: accept its terms .* set HF_TOKEN"),
    ],
)
def test_errors_name_the_problem(hub_site, name, message):
    with pytest.raises(hub.HubError, match=message):
        hub.pull(name)


def test_gated_repo_with_a_token(hub_site, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert hub.pull("org/gated-GGUF").read_bytes() == hub_site.dense


def test_interrupted_download_resumes_and_leaves_nothing_under_the_final_name(hub_site, tmp_path):
    name = "demo.powerinfer.gguf"  # 23.8 MB: huggingface_hub writes in 10 MiB pieces, so 11 MiB leaves one
    hub_site.cut_after[name] = 11 * 2**20
    with pytest.raises(hub.HubError, match=f"downloading {name} failed"):
        hub.pull("PowerInfer/Demo-PowerInfer-GGUF")
    repo = tmp_path / "hf" / "hub" / "models--PowerInfer--Demo-PowerInfer-GGUF"
    assert not list(repo.glob(f"snapshots/*/{name}"))  # nothing under the final name
    partial = list(repo.glob("blobs/*.incomplete"))
    assert len(partial) == 1
    done = partial[0].stat().st_size
    assert done == 10 * 2**20
    hub_site.broken = False
    hub_site.requests.clear()
    path = hub.pull("PowerInfer/Demo-PowerInfer-GGUF")
    assert path.read_bytes() == (DEMO / name).read_bytes()
    ranges = [h.get("Range") for m, p, h in hub_site.requests if m == "GET" and p.endswith(name)]
    assert ranges == [f"bytes={done}-"]  # resumed, not started again
    assert not list(repo.glob("blobs/*.incomplete"))


def test_list_and_rm(hub_site, tmp_path):
    hub.pull("org/tiny-GGUF")
    hub.pull("org/tiny-GGUF:Q8_0")
    rows = {(m.name, m.tag): m for m in hub.list_models()}
    assert set(rows) == {("org/tiny-GGUF", "Q4_K_M"), ("org/tiny-GGUF", "Q8_0")}
    assert rows["org/tiny-GGUF", "Q8_0"].size == len(hub_site.dense)
    hub.remove("org/tiny-GGUF:Q8_0")
    assert [(m.name, m.tag) for m in hub.list_models()] == [("org/tiny-GGUF", "Q4_K_M")]
    blobs = list((tmp_path / "hf" / "hub" / "models--org--tiny-GGUF" / "blobs").iterdir())
    assert len(blobs) == 1  # both files have the same bytes: the blob stays while a link points at it
    hub.remove("org/tiny-GGUF")
    assert hub.list_models() == []
    assert not (tmp_path / "hf" / "hub" / "models--org--tiny-GGUF").exists()
    with pytest.raises(hub.HubError, match="org/tiny-GGUF is not in the cache"):
        hub.remove("org/tiny-GGUF")


# ---------------------------------------------------------------------------------------------------
# commands


def test_cli_pull_list_rm(hub_site, capsys):
    assert main(["pull", "org/tiny-GGUF:Q8_0"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("tiny-Q8_0.gguf")
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "NAME" in listing and "org/tiny-GGUF" in listing and "Q8_0" in listing
    assert main(["rm", "org/tiny-GGUF"]) == 0
    assert main(["list"]) == 0
    assert "no models pulled yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pull", "org/missing"], "no model repository org/missing"),
        (["pull", "org/tiny-GGUF:nope"], "its tags: Q4_K_M, Q8_0"),
        (["generate", "-m", "org/tiny-GGUF", "--offline", "-p", "x"], "not in the cache"),
        (["rm", "org/tiny-GGUF"], "is not in the cache"),
    ],
)
def test_cli_errors_are_one_line(hub_site, capsys, argv, message):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_generate_with_a_model_name_and_the_load_api(hub_site, capsys):
    assert main(["generate", "-m", "org/tiny-GGUF", "-p", "Line 1", "-n", "3", "--temp", "0"]) == 0
    assert "generation" in capsys.readouterr().err
    import hotcold

    llm = hotcold.load("org/tiny-GGUF")
    assert llm.path.name == "tiny-Q4_K_M.gguf"


def test_run_chats_until_bye(hub_site, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/help\n\nWhat next?\n/bye\nnever read\n"))
    assert main(["run", "org/tiny-GGUF", "-n", "4", "--temp", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("tokens/s | FFN neurons computed") == 2  # two replies, each with its figures
    assert "/bye: end the chat" in captured.err


def test_run_ctrl_c_stops_a_reply_not_the_chat(monkeypatch, capsys, tiny_dense_gguf):
    from hotcold.api import Model

    original = Model.stream_chunks
    calls = []

    def interrupted(self, ids, **kwargs):
        calls.append(kwargs["max_tokens"])
        for i, chunk in enumerate(original(self, ids, **{**kwargs, "max_tokens": 20, "ignore_eos": True})):
            if i == 2 and len(calls) == 1:
                os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C during the first reply
            yield chunk

    monkeypatch.setattr(Model, "stream_chunks", interrupted)
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    assert main(["run", str(tiny_dense_gguf), "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("(stopped)") == 1  # the first reply stopped, the second ran to its end
    assert err.count("tokens/s") == 2
    assert "3 tokens in" in err  # stopped after the token being computed when Ctrl-C came


def test_run_drops_the_oldest_turns_when_the_context_is_full(tiny_dense_gguf):
    import hotcold
    from hotcold.cli.run import Prompt, fit_history

    llm = hotcold.load(tiny_dense_gguf, ctx_size=64)
    history = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        history += [
            {"role": "user", "content": f"question {i} " * 3},
            {"role": "assistant", "content": "answer " * 4},
        ]
    history.append({"role": "user", "content": "last"})
    kept, dropped = fit_history(Prompt(llm), history, 1, 8)
    assert dropped > 0 and kept[0]["role"] == "system" and kept[1]["role"] == "user"
    assert kept[-1] == {"role": "user", "content": "last"}
    assert len(llm.chat_prompt_ids(kept)) + 8 <= 64


def test_split_model_pulls_every_part_and_loads(hub_site, tmp_path, tiny_dense_gguf):
    import hotcold
    from tests.gguf.test_split import split_with_upstream_writer

    made = tmp_path / "made"
    made.mkdir()
    parts = split_with_upstream_writer(Path(tiny_dense_gguf), made, max_tensors=6)
    files = {p.name.replace("model-", "Tiny-Q6_K-"): p.read_bytes() for p in parts}
    hub_site.repos["org/split-GGUF"] = Repo(files | {"Tiny-Q8_0.gguf": hub_site.dense})
    path = hub.pull("org/split-GGUF:q6_k")
    assert path.name == f"Tiny-Q6_K-00001-of-{len(parts):05d}.gguf"
    assert sorted(p.name for p in path.parent.glob("Tiny-Q6_K-*")) == sorted(files)
    ids = [1, 5, 9]
    assert torch.equal(
        hotcold.load("org/split-GGUF:Q6_K").logits(ids), hotcold.load(tiny_dense_gguf).logits(ids)
    )
    [row] = [m for m in hub.list_models() if m.tag == "Q6_K"]
    assert row.size == sum(len(b) for b in files.values())


def test_run_goes_on_in_plain_text_when_the_template_fails(monkeypatch, capsys, tmp_path, tiny_dense_gguf):
    """#44: a template that raises is named in a warning, and the chat falls back to plain text."""
    from gguf import GGUFValueType

    from hotcold.gguf.io import ModelFile, TensorSpec, metadata_items, write_model_file

    mf = ModelFile(tiny_dense_gguf)
    meta = [m for m in metadata_items(mf) if m[0] != "tokenizer.chat_template"]
    meta.append(("tokenizer.chat_template", "{{ 1 // 0 }}", GGUFValueType.STRING, None))
    specs = [TensorSpec(e.name, e.shape, e.qtype, lambda e=e: e.data) for e in mf.tensors.values()]
    bad = tmp_path / "bad-template.gguf"
    write_model_file(bad, mf.architecture, meta, specs)
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    assert main(["run", str(bad), "-n", "2", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("the chat goes on in plain text") == 1 and "chat template" in err
    assert err.count("tokens/s") == 2


def test_the_token_stays_with_the_hub_on_a_redirect(hub_site, monkeypatch):
    """LFS files redirect to a storage host: the download follows without the Authorization header (as
    huggingface_hub does), and still resumes and lands whole."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub_site.lfs.add("tiny-Q4_K_M.gguf")
    assert hub.pull("org/tiny-GGUF").read_bytes() == hub_site.dense
    lower = [(p, {k.lower(): v for k, v in h.items()}) for _, p, h in hub_site.requests]
    to_hub = [h for p, h in lower if p.startswith("/org/")]
    to_cdn = [h for p, h in lower if p.startswith("/cdn/")]
    assert to_cdn and to_hub
    assert all(h.get("authorization") == "Bearer hf_secret" for h in to_hub)
    assert not any("authorization" in h for h in to_cdn)


def test_an_etag_that_is_not_a_hash_never_becomes_a_path(hub_site, tmp_path):
    hub_site.etags["tiny-Q4_K_M.gguf"] = "../../../../escaped"
    with pytest.raises(hub.HubError, match="ETag '../../../../escaped' is not a content hash"):
        hub.pull("org/tiny-GGUF")
    assert not list(tmp_path.rglob("escaped*"))  # huggingface_hub's own download would write there
    assert not (tmp_path / "escaped").exists()


def test_a_commit_pushed_during_a_pull_leaves_every_part_in_one_snapshot(hub_site, tmp_path, tiny_dense_gguf):
    from tests.gguf.test_split import split_with_upstream_writer

    made = tmp_path / "made"
    made.mkdir()
    parts = split_with_upstream_writer(Path(tiny_dense_gguf), made, max_tensors=6)
    files = {p.name.replace("model-", "Tiny-Q6_K-"): p.read_bytes() for p in parts}
    hub_site.repos["org/split-GGUF"] = Repo(files)
    first = sorted(files)[0]
    original = hub_site._answer

    def moving(h, *, body):  # the repository gets a new commit once the first part is served
        if h.command == "GET" and h.path.endswith(first):
            hub_site.commit = "b" * 40
        return original(h, body=body)

    hub_site._answer = moving
    path = hub.pull("org/split-GGUF:Q6_K")
    assert {p.name for p in path.parent.iterdir()} >= set(files)
    assert path.parent.name == "b" * 40  # the newest snapshot holds every part
    assert hub.pull("org/split-GGUF:Q6_K", offline=True) == path


def test_rm_of_a_tag_after_an_interrupted_split_pull(hub_site, tmp_path, tiny_dense_gguf):
    from tests.gguf.test_split import split_with_upstream_writer

    made = tmp_path / "made"
    made.mkdir()
    parts = split_with_upstream_writer(Path(tiny_dense_gguf), made, max_tensors=6)
    files = {p.name.replace("model-", "Tiny-Q6_K-"): p.read_bytes() for p in parts}
    hub_site.repos["org/split-GGUF"] = Repo(files | {"Tiny-Q8_0.gguf": hub_site.dense})
    hub.pull("org/split-GGUF:Q8_0")
    last = sorted(files)[-1]
    hub_site.cut_after[last] = 100  # the line drops in the last part: the pull stops partway
    with pytest.raises(hub.HubError):
        hub.pull("org/split-GGUF:Q6_K")
    removed = hub.remove("org/split-GGUF:Q6_K")
    assert removed and all("Q6_K" in p.name for p in removed)
    assert [m.tag for m in hub.list_models()] == ["Q8_0"]


def test_run_keeps_the_conversation_when_a_message_alone_does_not_fit(monkeypatch, capsys, tiny_dense_gguf):
    huge = "word " * 300
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hi\n{huge}\nagain\n"))
    assert main(["run", str(tiny_dense_gguf), "-c", "64", "-n", "4", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "that message alone does not fit the context" in err
    assert "are dropped" not in err  # the first exchange was kept (before: dropped with the long message)
    assert err.count("tokens/s") == 2
