"""The search tool and mindrl's local retrieval server (`mindrl-retrieval`): Search-R1's `/retrieve` request answered
with BM25's top-k (checked against a BM25 written out here), the corpus errors naming file and line, the tool's
observation from the served index, and every failure of the service as a `ToolError` the model is shown. The
servers run in this process's threads on loopback (no subprocess, no model)."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
import yaml

from mindrl.agent.retrieval import CorpusError, Retriever, load_corpus
from mindrl.agent.tools import SearchTool, ToolConfigError, ToolError, build_tools
from mindrl.cli.retrieval import main, make_server

# Lowercase words, none an English stopword, so BM25's tokens are the whitespace split (the reference below).
DOCS = [
    ("d0", "Etna", "etna volcano sicily volcano eruption volcano"),
    ("d1", "Paris", "paris capital france river seine"),
    ("d2", "Vesuvius", "vesuvius volcano naples pompeii"),
    ("d3", "Lyon", "lyon city france food"),
    ("d4", "Fuji", "fuji mountain japan volcano snow peak tallest"),
    ("d5", "Rhone", "rhone river lyon france alps valley"),
]

# MindSpeed-RL's configs/tools/search_tool_config.yaml entry (its `item` is theirs: JSON Schema's word is `items`)
SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {"type": "array", "item": {"type": "string"}, "description": "A list of queries."}
            },
            "required": ["query_list"],
        },
    },
}


def write_corpus(path) -> str:
    path.write_text("".join(json.dumps({"id": i, "contents": f"{t}\n{text}"}) + "\n" for i, t, text in DOCS))
    return str(path)


@contextlib.contextmanager
def serving(corpus: str) -> Iterator[str]:
    """`mindrl-retrieval`'s server over `corpus` on a free loopback port, in a thread: its /retrieve URL."""
    server = make_server(Retriever.from_file(corpus))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> Iterator[str]:
    with serving(write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")) as u:
        yield u


def bm25_reference(query: str, k1: float = 1.5, b: float = 0.75) -> list[tuple[str, float]]:
    """Lucene's BM25 (bm25s' default) in fp64, straight from its formula: every document's score, best first."""
    docs = [(i, f"{t}\n{text}".lower().split()) for i, t, text in DOCS]
    avg = sum(len(d) for _, d in docs) / len(docs)
    scores = []
    for i, d in docs:
        s = 0.0
        for term in query.split():
            df = sum(term in dd for _, dd in docs)
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = d.count(term)
            s += idf * tf / (tf + k1 * (1 - b + b * len(d) / avg))
        scores.append((i, s))
    return sorted(scores, key=lambda x: -x[1])


def post(url, body):
    return requests.post(url, json=body, timeout=10)


def search_tool(url, **config) -> SearchTool:
    return SearchTool({"retrieval_service_url": url, **config}, SEARCH_SCHEMA)


@pytest.mark.parametrize("query", ["volcano", "france river", "lyon food volcano"])
def test_the_server_answers_search_r1s_request_with_bm25s_top_k(url, query):
    resp = post(url, {"queries": [query, "tallest peak"], "topk": 3, "return_scores": True})
    assert resp.status_code == 200
    result = resp.json()["result"]
    assert len(result) == 2 and all(len(hits) == 3 for hits in result)
    ref = bm25_reference(query)
    assert ref[2][1] > ref[3][1], "the corpus must separate the top 3 from the rest"
    assert [h["document"]["id"] for h in result[0]] == [i for i, _ in ref[:3]]
    # bm25s keeps its scores in float32: 1e-6 relative is a few float32 roundings of the fp64 reference
    assert [h["score"] for h in result[0]] == pytest.approx([s for _, s in ref[:3]], rel=1e-6)
    assert result[1][0]["document"] == {"id": "d4", "contents": "Fuji\nfuji mountain japan volcano snow peak tallest"}
    bare = post(url, {"queries": [query], "topk": 2}).json()["result"]
    assert [row["id"] for row in bare[0]] == [i for i, _ in ref[:2]]


def test_the_server_gives_at_most_the_corpus_and_answers_unknown_words(url):
    result = post(url, {"queries": ["volcano", "zzz qqq"], "topk": 50}).json()["result"]
    assert [len(h) for h in result] == [len(DOCS), len(DOCS)]


@pytest.mark.parametrize(
    "body, says",
    [
        ({"queries": "volcano"}, "'queries' must be a list of strings"),
        ({"queries": ["a", 3]}, "'queries' must be a list of strings"),
        ({"queries": ["a"], "topk": 0}, "'topk' must be an integer in 1..100"),
        ({"queries": ["a"], "return_scores": "yes"}, "'return_scores' must be true or false"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_request_is_a_400_that_names_the_key(url, body, says):
    resp = post(url, body)
    assert resp.status_code == 400 and says in resp.json()["error"]


def test_a_wrong_path_or_a_body_that_is_not_json(url):
    resp = post(url.replace("/retrieve", "/search"), {"queries": ["a"]})
    assert resp.status_code == 404 and "POST /retrieve" in resp.json()["error"]
    resp = requests.post(url, data=b"{not json", timeout=10)
    assert resp.status_code == 400 and "not JSON" in resp.json()["error"]


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "a row must be a JSON object"),
        ('{"id": "x"}', "'contents' must be a string"),
        ('{"id": 1.5, "contents": "a"}', "'id' must be a string or an integer"),
        ('{"id": "d1", "contents": "again"}', "id 'd1' is also line 2's"),
    ],
)
def test_a_bad_corpus_row_names_the_file_and_line(tmp_path, line, says, capsys):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"id": f"d{i}", "contents": "t\nx"}) for i in range(3)]
    path.write_text("\n".join([good[0], good[1], "", line, good[2]]) + "\n")
    with pytest.raises(CorpusError) as e:
        load_corpus(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and says in str(e.value)
    assert main(["--corpus", str(path), "--port", "0"]) == 2
    assert f"mindrl-retrieval: {path}:4: " in capsys.readouterr().err


def test_an_empty_or_missing_corpus_is_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(CorpusError, match="empty.jsonl: the corpus has no rows"):
        load_corpus(str(tmp_path / "empty.jsonl"))
    with pytest.raises(CorpusError, match="nope.jsonl: cannot read the corpus"):
        load_corpus(str(tmp_path / "nope.jsonl"))


def test_help_names_the_corpus_and_port(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--corpus" in out and "--port" in out and "/retrieve" in out


def test_mindspeed_rls_search_yaml_builds_the_tool_and_it_searches_the_served_corpus(tmp_path, url):
    config = {"retrieval_service_url": url, "num_workers": 120, "enable_global_rate_limit": True,
              "rate_limit": 120, "timeout": 30, "topk": 2, "type": "native"}  # fmt: skip
    path = tmp_path / "search_tool_config.yaml"
    entry = {"class_name": "mindspeed_rl.tools.search_tool.SearchTool", "config": config, "tool_schema": SEARCH_SCHEMA}
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    tool = build_tools(str(path))["search"]
    assert isinstance(tool, SearchTool) and tool.topk == 2
    obs = tool.execute({"query_list": ["volcano", "france river"]})
    v1, v2 = (i for i, _ in bm25_reference("volcano")[:2])
    f1, f2 = (i for i, _ in bm25_reference("france river")[:2])
    text = {i: f"Doc {{}} (Title: {t})\n{body}" for i, t, body in DOCS}
    assert obs == "\n---\n".join(
        [f"{text[v1].format(1)}\n\n{text[v2].format(2)}", f"{text[f1].format(1)}\n\n{text[f2].format(2)}"]
    )


@pytest.mark.parametrize(
    "config, says",
    [
        ({}, "config.retrieval_service_url: an http\\(s\\) URL"),
        ({"retrieval_service_url": "localhost:8000/retrieve"}, "config.retrieval_service_url"),
        ({"retrieval_service_url": "http://x/retrieve", "topk": 0}, "config.topk: must be an integer in 1..100"),
        ({"retrieval_service_url": "http://x/retrieve", "timeout": -1}, "config.timeout: must be a positive number"),
        ({"retrieval_service_url": "http://x/retrieve", "retries": 3}, r"config: unknown key\(s\) \[.retries.\]"),
    ],
)
def test_a_bad_search_config_names_the_key(tmp_path, config, says):
    path = tmp_path / "tools.yaml"
    path.write_text(
        yaml.safe_dump({"tools": [{"class_name": "search", "config": config, "tool_schema": SEARCH_SCHEMA}]})
    )
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \(search\): " + says):
        build_tools(str(path))


@pytest.mark.parametrize("args", [{"query_list": []}, {"query_list": "volcano"}, {"query_list": ["ok", ""]}, {}])
def test_bad_query_lists_are_tool_errors(url, args):
    with pytest.raises(ToolError, match="'query_list' must be a non-empty list of non-empty strings"):
        search_tool(url).execute(args)


class _Answer(BaseHTTPRequestHandler):
    body, code = b"", 200

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.code)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def answering(body: bytes, code: int = 200) -> Iterator[str]:
    """A server that answers every POST with `body` (a broken retrieval service)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Answer,), {"body": body, "code": code}))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    "body, code, says",
    [
        (b"<html>busy</html>", 200, "did not answer: JSONDecodeError"),
        (b'{"error": "overloaded"}', 503, "answered HTTP 503: overloaded"),
        (b'{"result": [[]]}', 200, "no 'result' list of 2 queries' hits"),
        (b'{"result": [[{"document": {"id": 1}}], []]}', 200, "hits without document 'contents'"),
        (b'{"result": [[5], []]}', 200, "hits without document 'contents'"),
    ],
)
def test_a_broken_service_is_a_tool_error(body, code, says):
    with answering(body, code) as u, pytest.raises(ToolError, match=says):
        search_tool(u).execute({"query_list": ["a", "b"]})


def test_a_service_that_is_down_or_silent_is_a_tool_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        # bound, not listening: connections are refused
        with pytest.raises(ToolError, match="did not answer: ConnectionError"):
            search_tool(f"http://127.0.0.1:{port}/retrieve").execute({"query_list": ["a"]})
        # listening, never answering: the kernel completes the connection, the reply never comes
        s.listen(1)
        with pytest.raises(ToolError, match=r"did not answer within 0.2 s"):
            search_tool(f"http://127.0.0.1:{port}/retrieve", timeout=0.2).execute({"query_list": ["a"]})


def test_the_console_entry_serves_the_corpus(tmp_path):
    """`mindrl-retrieval` as a process (its module, as the console script runs it): it prints the URL it serves and
    answers there; terminated, it is gone."""
    import subprocess
    import sys

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cmd = [sys.executable, "-m", "mindrl.cli.retrieval", "--corpus", corpus, "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # the first line names the URL, once the index is built and the port bound
        assert f"6 documents from {corpus}; serving http://127.0.0.1:" in line, line
        served = line.split("serving ")[1].strip()
        hits = post(served, {"queries": ["volcano"], "topk": 1}).json()["result"]
        assert hits == [[{"id": "d0", "contents": "Etna\netna volcano sicily volcano eruption volcano"}]]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode is not None


def check_the_index_leaves_numba_out() -> None:
    """In a fresh interpreter (tests/procs.check_in_fresh_process): bm25s imports numba whenever it is installed, and
    numba's llvmlite objects in sys.modules broke every vLLM engine started later in the same process (its kernel
    rebinding scans all module namespaces); the retriever indexes with numba hidden, and numba stays importable."""
    import sys

    from mindrl.agent.retrieval import Retriever

    r = Retriever([{"id": "1", "contents": "alpha beta"}, {"id": "2", "contents": "gamma delta"}])
    assert r.index is not None
    assert not any(m == "numba" or m.startswith(("numba.", "llvmlite")) for m in sys.modules)
    import numba  # noqa: F401  (hidden only while bm25s imported)

    print("check_the_index_leaves_numba_out: ok")


def test_the_index_leaves_numba_out():
    from tests.procs import check_in_fresh_process

    check_in_fresh_process("tests.agent.test_search", "check_the_index_leaves_numba_out")


def test_the_search_tasks_traces_show_what_the_server_answers(tmp_path):
    """tools/make_search_data.py: the SFT and RL splits name different people, and each tool-use trace's observation
    is the search tool's answer from mindrl-retrieval over the written corpus, holding the label."""
    from mindrl.trainer.pipeline.agent_loop import ChatFormat
    from tools.make_search_data import TOOL_NAME, TOPK, main, tool_call

    main(["--out", str(tmp_path), "--sft-people", "200", "--tool-share", "1.0"])
    sft, rl = (json.loads((tmp_path / f"{s}.json").read_text()) for s in ("sft", "rl"))
    assert len(sft) == 200 and len(rl) == 56 and not {r["problem"] for r in sft} & {r["problem"] for r in rl}
    [tool] = build_tools(str(tmp_path / "tools.yaml")).values()
    assert tool.name == TOOL_NAME and tool.topk == TOPK
    chat = ChatFormat()
    with serving(str(tmp_path / "corpus.jsonl")) as live:
        tool.url = live
        for row in rl[:8]:
            name = row["problem"].removeprefix("What is the badge number of ").removeprefix("Which badge number does ")
            name = name.removesuffix("?").removesuffix(" have")
            call = tool_call(name)
            observation = tool.execute({"query_list": [name]})
            assert row["solution"].startswith(call + chat.observation(call, [observation]))
            assert f"{name}'s badge number is {row['answer']}." in observation


def test_the_tool_servers_hold_an_agent_loops_concurrent_calls():
    """mindrl-retrieval's and mindrl-sandbox's server queues 64 connections it has not accepted yet (the agent loop
    calls a turn's tools at once); http.server's default backlog of 5 drops the rest, which resend a second later."""
    from mindrl.cli import ToolServer

    def queued(server_class, n: int) -> int:
        server = server_class(("127.0.0.1", 0), BaseHTTPRequestHandler)  # listening, never accepting
        clients, done = [], 0
        try:
            for _ in range(n):
                c = socket.socket()
                c.settimeout(0.1)
                clients.append(c)
                try:
                    c.connect(server.server_address)
                    done += 1
                except OSError:  # the SYN was dropped: the client would resend after a second
                    pass
        finally:
            for c in clients:
                c.close()
            server.server_close()
        return done

    assert queued(ToolServer, 64) == 64
    assert queued(ThreadingHTTPServer, 12) < 12  # the control: the default backlog does drop them
