"""The run directory: its state, and the writer lock that keeps a second writer out."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import run_nmt, start_nmt, tiny_run, wait_until

from nmt import NMTError, checkpoint, config
from nmt.compare import Run, ensure_trained
from nmt.data.prepare import prepare
from nmt.run import RunDir, attach

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny" / "transformer.yaml"


def holding(run: Path) -> subprocess.Popen:
    """A process that holds the run's writer lock until killed."""
    code = (
        "import sys, time\n"
        "from nmt.run import RunDir\n"
        "with RunDir(sys.argv[1]).writer():\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def as_nobody(code: str, *args) -> subprocess.CompletedProcess:
    """`code` in a fresh Python where NOBODY() becomes the unprivileged user nobody when
    running as root (call it after the imports: root's Python is not readable by nobody)."""
    become = (
        "import os, sys\n"
        "def NOBODY():\n"
        "    if os.geteuid() == 0:\n"
        "        os.setgid(65534); os.setuid(65534)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", become + code, *map(str, args)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )


def files_of(run: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


# -- state ----------------------------------------------------------------------------------


def test_the_run_state_on_each_state(tmp_path):
    trained, cfg = tiny_run("transformer", 40)  # finished at train.max_steps=40
    empty = RunDir(tmp_path / "nothing-here")
    assert empty.state().kind == "empty" and not empty.path.exists()
    configured = RunDir(tmp_path / "configured")
    attach(prepare(cfg), cfg, configured.path)
    assert configured.state(cfg.train).kind == "configured"

    run = RunDir(tmp_path / "run")
    shutil.copytree(trained, run.path)
    finished = run.state(cfg.train)
    assert (finished.kind, finished.reason) == ("finished", "reached train.max_steps=40")
    assert finished.progress.step == 40
    assert run.state().kind == "finished"  # by the budget it ended under
    more = config.replace(cfg, ["train.max_steps=60"])
    assert run.state(more.train).kind == "resumable"  # a larger budget leaves work to do
    minutes = config.replace(cfg, ["train.max_steps=null", "train.max_minutes=1000"])
    assert run.state(minutes.train).kind == "resumable"

    payload = checkpoint.load(run.checkpoint("last"))
    payload["progress"]["finished"] = ""  # as saved by a run that was interrupted
    checkpoint.save(payload, run.checkpoint("last"))
    assert run.state().kind == "resumable"

    run.checkpoint("last").write_bytes(b"not a checkpoint")
    with pytest.raises(NMTError, match="cannot read checkpoint"):
        run.state(cfg.train)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(NMTError, match="is a file, not a run directory"):
        RunDir(a_file).state()


def test_the_layout_names_every_file_of_a_trained_run():
    trained, _ = tiny_run("transformer", 40)
    run = RunDir(trained)
    named = {run.config_file, run.metrics_file, run.log_file, run.lock_file}
    named |= {run.checkpoint(k) for k in ("last", "best")} | set(run.step_checkpoints())
    named |= {run.tokenizer_dir / name for name in run.tokenizer_files()}
    files = {p for p in trained.rglob("*") if p.is_file()}
    assert named <= files
    # Other tests may have averaged or evaluated this shared run: files the layout names too.
    for extra in files - named:
        assert extra == run.checkpoint("averaged") or extra.parent.name == "translations", extra
    # Saves every 10 steps, the last two step checkpoints kept; step 40 is last.pt only.
    assert [p.name for p in run.step_checkpoints()] == ["step-20.pt", "step-30.pt"]
    assert run.model_checkpoint() == run.checkpoint("best")


def test_a_folder_of_other_files_is_never_taken_for_a_run(tmp_path):
    """`--run-dir` naming a folder of the user's own (a config.yaml of theirs among other
    files) is refused by prepare and train in one line, nothing written into it: training
    replaced the config.yaml by its own and wrote logs and folders beside the files. An empty
    folder, or one holding only the writer's lock, is a new run."""
    own = tmp_path / "project"
    own.mkdir()
    (own / "config.yaml").write_text("server: {port: 80}\n")
    (own / "notes.txt").write_text("mine\n")
    for command in ("prepare", "train"):
        res = run_nmt(command, TINY, "--run-dir", own, "--set", "train.max_steps=2")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert "holds files of its own and no nmt run" in res.stderr
        assert sorted(p.name for p in own.iterdir()) == ["config.yaml", "notes.txt"]
        assert (own / "config.yaml").read_text() == "server: {port: 80}\n"
    (own / "config.yaml").unlink()  # other files and no config at all: the same
    res = run_nmt("prepare", TINY, "--run-dir", own)
    assert res.returncode == 2 and "no nmt run" in res.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".lock").write_text("")
    res = run_nmt("prepare", TINY, "--run-dir", empty)
    assert res.returncode == 0, res.stderr
    assert (empty / "config.yaml").is_file()
    res = run_nmt("prepare", TINY, "--run-dir", empty)  # a run now: prepared again
    assert res.returncode == 0, res.stderr


# -- the writer lock ------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_a_killed_holder_blocks_nobody(tmp_path):
    run = RunDir(tmp_path / "run")
    holder = holding(run.path)
    try:
        with pytest.raises(NMTError) as refused:
            with run.writer():
                pass
        assert f"pid {holder.pid} on " in str(refused.value) and "another process" in str(
            refused.value
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run.writer():  # the OS released the dead holder's lock
        assert str(os.getpid()) in run.lock_file.read_text()
    assert run.lock_file.read_text() == ""  # emptied on release


def test_two_trainings_on_one_run_directory(tmp_path):
    """The second is refused at once (exit 2, one line naming the holder); the first trains
    to the end undisturbed."""
    run = tmp_path / "run"
    sets = ["--set", "train.max_steps=40", "--set", "train.valid_every=20"]
    first = start_nmt("train", TINY, "--run-dir", run, *sets)
    try:
        wait_until(lambda: (run / ".lock").is_file() and (run / ".lock").read_text(), first)
        second = run_nmt("train", TINY, "--run-dir", run, *sets)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().count("\n") == 0 and "Traceback" not in second.stderr
        assert f"pid {first.pid} on " in second.stderr
        resumed = run_nmt("train", TINY, "--run-dir", run, "--resume", *sets)
        assert resumed.returncode == 2 and f"pid {first.pid}" in resumed.stderr
    finally:
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    records = RunDir(run).metrics()
    assert [r["step"] for r in records if r["kind"] == "train"] == [10, 20, 30, 40]
    assert checkpoint.load(run / "checkpoints" / "last.pt")["progress"]["step"] == 40


def test_a_new_run_drops_the_records_of_an_attempt_killed_before_its_first_checkpoint(
    tmp_path,
):
    """A run killed before its first save leaves its directory configured, with the records
    it logged (and maybe half a line): the next training starts anew there, and its
    metrics.jsonl holds its own records only, every line whole."""
    sets = ["train.max_steps=20", "train.valid_every=20", "train.log_every=10"]
    cfg = config.load(TINY, sets)
    run = RunDir(tmp_path / "run")
    attach(prepare(cfg), cfg, run.path)
    stale = [{"kind": "train", "step": s, "loss": 9.0} for s in (10, 20, 30)]
    run.metrics_file.write_text(
        "".join(json.dumps(r) + "\n" for r in stale) + '{"kind": "train", "st'
    )
    assert run.state(cfg.train).kind == "configured"
    res = run_nmt("train", TINY, "--run-dir", run.path, *[a for x in sets for a in ("--set", x)])
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [10, 20]
    assert all(r.get("loss") != 9.0 for r in records)


def test_two_writers_of_one_output_each_write_a_whole_file(tmp_path):
    """`replacing` (nmt translate --output, nmt evaluate's files): two processes writing the
    same path at once each stream into a temporary file of their own, so the path ends up
    whole, one writer's lines or the other's, never a mix, and no temporary file is left."""
    out = tmp_path / "out.txt"
    code = (
        "import sys, time\n"
        "from nmt.files import replacing\n"
        "with replacing(sys.argv[1]) as f:\n"
        "    for i in range(4):\n"
        "        f.write(sys.argv[2] * 1000 + '\\n'); f.flush(); time.sleep(float(sys.argv[3]))\n"
    )
    slow = subprocess.Popen(
        [sys.executable, "-c", code, str(out), "a", "1.0"], stderr=subprocess.PIPE, text=True
    )
    own = tmp_path / f".out.txt.tmp-{slow.pid}"
    wait_until(lambda: own.is_file() and own.stat().st_size > 0, slow)  # it has begun
    subprocess.run([sys.executable, "-c", code, str(out), "b", "0"], check=True)
    assert out.read_text() == ("b" * 1000 + "\n") * 4
    assert slow.wait(timeout=60) == 0
    assert out.read_text() == ("a" * 1000 + "\n") * 4  # the last to finish, whole
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_outputs_write_through_links_and_into_pipes(tmp_path):
    """A symbolic link given as an output stays a link (the file it names gets the lines; it
    was replaced by a file, the file left as it was); what is not a file (a named pipe,
    /dev/null, /dev/stdout) is written to, never replaced by a file (as root, `-o /dev/null`
    replaced the device)."""
    import threading

    from nmt.files import replacing, write_atomic

    target = tmp_path / "target.txt"
    target.write_text("precious\n")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    with replacing(link) as f:
        f.write("new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    write_atomic(link, "newer\n")
    assert link.is_symlink() and target.read_text() == "newer\n"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    with replacing(fifo) as f:
        f.write("through the pipe\n")
    reader.join(timeout=30)
    assert got == ["through the pipe\n"] and fifo.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "pipe", "target.txt"]


def test_a_replaced_output_keeps_its_permissions_and_a_read_only_one_is_left_alone(tmp_path):
    """A file an output replaces keeps its mode (a private 0600 file became 0644, readable by
    all); a file read-only to the user is refused in one line, as a shell's `>` refuses it,
    instead of being replaced by a rename (which only needs the folder to be writable)."""
    from nmt.files import replacing, write_atomic

    private = tmp_path / "private.txt"
    private.write_text("old\n")
    private.chmod(0o600)
    with replacing(private) as f:
        f.write("new\n")
    assert private.read_text() == "new\n" and stat.S_IMODE(private.stat().st_mode) == 0o600
    private.chmod(0o640)
    write_atomic(private, "newer\n")
    assert stat.S_IMODE(private.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.txt"
    with replacing(fresh) as f:
        f.write("x\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask

    shared = Path(tempfile.mkdtemp())  # pytest's own folders are private to their owner
    try:
        shared.chmod(0o777)
        kept = shared / "kept.txt"
        kept.write_text("precious\n")
        kept.chmod(0o444)
        code = (  # root may write any file
            "from nmt import NMTError\n"
            "from nmt.files import replacing\n"
            "NOBODY()\n"
            "try:\n"
            "    with replacing(sys.argv[1]) as f:\n"
            "        f.write('clobbered\\n')\n"
            "except NMTError as e:\n"
            "    print(e)\n"
        )
        res = as_nobody(code, kept)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == (
            f"cannot write --output {kept}: it is read-only; make it writable or write elsewhere"
        )
        assert kept.read_text() == "precious\n"
        assert sorted(p.name for p in shared.iterdir()) == ["kept.txt"]
    finally:
        shutil.rmtree(shared)


def test_a_trained_run_takes_only_settings_that_keep_it_the_same_run(tmp_path):
    """A trained run's config: budgets, cadence, decoding and where its data is read from may
    change (a cache moved: data.cache_dir was refused); what trains the model may not."""
    data = tmp_path / "data"
    data.mkdir()
    for lang, text in (("en", "A dog runs in the park ."), ("de", "Ein Hund rennt im Park .")):
        (data / f"train.{lang}").write_text("".join(f"{text} {i}\n" for i in range(300)))
    cfg = config.from_dict(
        {
            "data": {
                "source": "text",
                "train": str(data / "train"),
                "valid": str(data / "train"),
                "test": [],
            },
            "tokenizer": {"vocab_size": 60},
        }
    )
    run = RunDir(tmp_path / "run")
    run.attach(cfg, prepare(cfg).tokenizer_files)
    run.checkpoints_dir.mkdir()
    (run.checkpoints_dir / "last.pt").write_bytes(b"trained")
    moved = [f"data.cache_dir={tmp_path / 'moved'}", "data.num_proc=2", "train.max_steps=5000"]
    moved.append("decode.beam=2")
    again = config.replace(cfg, moved)
    run.attach(again, prepare(again).tokenizer_files)
    assert run.saved_config([]).train.max_steps == 5000
    other = config.replace(again, ["train.lr=0.1", "model.d_model=64"])
    with pytest.raises(NMTError, match=r"different config \(model.d_model, train.lr\)"):
        run.attach(other, prepare(other).tokenizer_files)
    vocabulary = config.replace(again, ["tokenizer.vocab_size=50"])  # said, not "data changed"
    with pytest.raises(NMTError, match=r"different config \(tokenizer.vocab_size\)"):
        run.attach(vocabulary, prepare(vocabulary).tokenizer_files)


def test_a_trained_runs_tokenizer_is_never_replaced(tmp_path, monkeypatch):
    """The data of a trained run's recipe changed (the recipe did not): nmt prepare trained
    another tokenizer and wrote it over the run's, whose checkpoints' token ids then meant
    other pieces (and --resume trained on). Refused; the same data prepared again (another
    cache: a tokenizer file that differs only in the paths it records) is not."""
    data = tmp_path / "data"
    data.mkdir()
    for lang, text in (("en", "A dog runs in the park ."), ("de", "Ein Hund rennt im Park .")):
        (data / f"train.{lang}").write_text("".join(f"{text} {i}\n" for i in range(300)))
    recipe = {
        "data": {"source": "text", "train": str(data / "train"), "valid": str(data / "train")},
        "tokenizer": {"vocab_size": 60},
    }
    recipe["data"]["test"] = []
    cfg = config.from_dict(recipe)
    run = RunDir(tmp_path / "run")
    run.attach(cfg, prepare(cfg).tokenizer_files)
    run.checkpoints_dir.mkdir()
    (run.checkpoints_dir / "last.pt").write_bytes(b"trained")
    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path / "other-cache"))
    run.attach(cfg, prepare(cfg).tokenizer_files)  # the same pieces: accepted
    before = (run.tokenizer_dir / "spm.model").read_bytes()
    (data / "train.en").write_text("".join(f"Two cats sleep on a sofa {i}\n" for i in range(300)))
    with pytest.raises(NMTError, match="already holds a run trained with another tokenizer"):
        run.attach(cfg, prepare(cfg).tokenizer_files)
    assert (run.tokenizer_dir / "spm.model").read_bytes() == before


def test_a_sigkilled_training_leaves_no_lock_behind(tmp_path):
    run = tmp_path / "run"
    sets = ["--set", "train.max_steps=400", "--set", "train.save_every=5"]
    proc = start_nmt("train", TINY, "--run-dir", run, *sets, "--set", "train.valid_every=1000")
    wait_until(lambda: (run / "checkpoints" / "last.pt").is_file(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / ".lock").read_text()  # the killed holder's name is still written there
    res = run_nmt("train", TINY, "--run-dir", run, "--resume", "--set", "train.max_steps=12")
    assert res.returncode == 0, res.stderr
    assert checkpoint.load(run / "checkpoints" / "last.pt")["progress"]["step"] == 12


def test_compare_and_average_refuse_a_run_another_process_writes(tmp_path):
    trained, cfg = tiny_run("transformer", 40)
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = files_of(run)
    holder = holding(run)
    try:
        with pytest.raises(NMTError, match=f"pid {holder.pid} on "):
            ensure_trained(
                "transformer", Run(cfg.train.seed, cfg, run), lambda: None, lambda _: None
            )
        res = run_nmt("average", run, "--last", "2")
        assert res.returncode == 2 and f"pid {holder.pid}" in res.stderr
        assert not (run / "checkpoints" / "averaged.pt").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert {p: b for p, b in files_of(run).items() if p.name != ".lock"} == {
        p: b for p, b in before.items() if p.name != ".lock"
    }
    said = []
    reused = ensure_trained("transformer", Run(cfg.train.seed, cfg, run), lambda: None, said.append)
    assert reused == "reused"
    assert "reusing finished run" in said[0]


def test_readers_need_no_lock(tmp_path):
    """translate (and evaluate) read a run that a writer holds."""
    trained, _ = tiny_run("transformer", 40)
    holder = holding(trained)
    try:
        src = tmp_path / "in.en"
        src.write_text("A dog runs.\n")
        res = run_nmt("translate", trained, "--input", src)
        assert res.returncode == 0 and res.stdout.count("\n") == 1, res.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


# -- what killed, interrupted or edited runs leave ---------------------------------------------


def test_a_run_whose_config_yaml_is_gone_is_not_resumed_with_the_recipe(tmp_path):
    """Without config.yaml a resume trained on under the recipe's settings (another lr,
    silently written into config.yaml and last.pt): refused in one line, nothing written."""
    trained, _ = tiny_run("transformer", 40)
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "config.yaml").unlink()
    before = files_of(run)
    res = run_nmt("train", TINY, "--run-dir", run, "--resume", "--set", "train.max_steps=45")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "holds checkpoints but no config.yaml of nmt's" in res.stderr
    assert files_of(run) == before


def test_a_last_pt_of_a_run_on_other_data_is_not_resumed(tmp_path):
    """The data and tokenizer a checkpoint's token ids are of are checked on resume, not only
    its model section; where and how the data is read (data.num_proc...) may differ."""
    from nmt.train import check_resumable

    trained, cfg = tiny_run("transformer", 40)
    last = trained / "checkpoints" / "last.pt"
    check_resumable(last, config.replace(cfg, ["data.num_proc=2", "train.max_steps=80"]))
    for change, key in (
        ("data.limit_train=1500", "data.limit_train"),
        ("tokenizer.vocab_size=999", "tokenizer.vocab_size"),
    ):
        with pytest.raises(NMTError, match=f"its {key} is"):
            check_resumable(last, config.replace(cfg, [change]))


def test_checkpoints_read_from_elsewhere_still_average(tmp_path):
    """A run resumed with data.num_proc changed (a key a resume may change) saves
    checkpoints that differ there only: they average (refused before, and train.average_last
    failed at the very end of such a run)."""
    trained, _ = tiny_run("transformer", 40)
    a, b = sorted((trained / "checkpoints").glob("step-*.pt"))
    payload = checkpoint.load(b)
    payload["config"]["data"]["num_proc"] = 2
    moved = tmp_path / "step-moved.pt"
    checkpoint.save(payload, moved)
    averaged = checkpoint.average([a, moved])
    assert sorted(averaged["model"]) == sorted(payload["model"])


def test_signals_wait_for_files_that_change_together():
    """signals_deferred: a Ctrl-C inside the scope (nmt average writing best.pt, last.pt and
    metrics.jsonl) is delivered when the scope ends, not in between."""
    from nmt.train import signals_deferred

    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("first")
            done.append("second")
    assert done == ["first", "second"]


def test_a_record_after_a_line_cut_short_is_kept(tmp_path):
    """A kill mid-write leaves half a line in metrics.jsonl, which reading drops; a record
    appended after it (nmt average's) was joined to that half line and dropped with it."""
    from nmt.run import RunLog, read_metrics

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    whole = [{"kind": "train", "step": s, "loss": 2.0} for s in (10, 20)]
    run.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"kind": "tr')
    with RunLog(run, None, False) as log:
        log.record({"kind": "valid", "step": 20, "loss": 1.5})
    assert read_metrics(run.metrics_file) == [*whole, {"kind": "valid", "step": 20, "loss": 1.5}]


def test_the_next_writer_removes_what_a_killed_save_left(tmp_path):
    """A save killed mid-write leaves .NAME.pt.tmp-PID: removed by the next writer of the run
    (another process's, still writing, kept); a run holding only such a file has no
    checkpoint (it was refused as a trained run with another config)."""
    run = RunDir(tmp_path / "run")
    assert run_nmt("prepare", TINY, "--run-dir", run.path).returncode == 0
    run.checkpoints_dir.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    left = run.checkpoints_dir / f".last.pt.tmp-{dead.stdout.strip()}"
    left.write_bytes(b"half a checkpoint")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = run.checkpoints_dir / f".step-5.pt.tmp-{sleeper.pid}"
        busy.write_bytes(b"being written")
        assert not run.trained()
        with run.writer():
            pass
        assert not left.exists() and busy.exists()
        # a new run's folder while its first config.yaml is being written (another rank of a
        # distributed run checks it then): nmt's own, not the user's
        new = RunDir(tmp_path / "new")
        new.path.mkdir()
        (new.path / ".lock").write_text("")
        (new.path / f".config.yaml.tmp-{sleeper.pid}").write_text("data:\n")
        new.check_is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()
    res = run_nmt("prepare", TINY, "--run-dir", run.path, "--set", "train.lr=0.001")
    assert res.returncode == 0, res.stderr


def test_prepare_removes_the_work_a_killed_prepare_left(tmp_path, monkeypatch):
    """SIGTERM and SIGKILL run no cleanup: a prepare killed midway left its work folder in
    the cache for good; the next preparation of that data removes it."""
    from nmt.data.prepare import prepared_dir

    monkeypatch.setenv("NMT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config.load(TINY, ["data.limit_train=300"])
    final = prepared_dir(cfg)
    left = final.parent / f".tmp-{final.name}-99999999"
    left.mkdir(parents=True)
    (left / "half.arrow").write_bytes(b"x" * 100)
    # a live process' work folder is left alone: a preparer that got the lock after its
    # holder ended (the lock file is unlinked then) while another still works
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        working = final.parent / f".tmp-{final.name}-{sleeper.pid}"
        working.mkdir()
        assert not prepare(cfg).reused
        assert not left.exists() and working.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_lock_of_a_run_one_may_only_read_is_checked_read_only(tmp_path):
    """check_not_written (nmt compare reusing a finished run, a quick check before work)
    opened RUN/.lock for writing: refused with Permission denied on a run of another user."""
    shared = Path(tempfile.mkdtemp())
    try:
        shared.chmod(0o755)
        (shared / ".lock").write_text("")
        (shared / ".lock").chmod(0o644)
        code = "from nmt.run import RunDir\nNOBODY()\nRunDir(sys.argv[1]).check_not_written()\n"
        res = as_nobody(code + "print('checked')\n", shared)
        assert res.returncode == 0 and res.stdout == "checked\n", res.stderr
    finally:
        shutil.rmtree(shared)


def test_prepare_refuses_a_busy_run_before_preparing(tmp_path, monkeypatch):
    """nmt prepare on a run another process writes: refused before the data is prepared
    (minutes of a tokenizer's training on a real corpus, thrown away)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NMT_CACHE_DIR", str(cache))
    run = tmp_path / "run"
    run.mkdir()
    holder = holding(run)
    try:
        res = run_nmt("prepare", TINY, "--run-dir", run)
        assert res.returncode == 2 and f"pid {holder.pid}" in res.stderr
        assert not (cache / "prepared").exists() or not any((cache / "prepared").iterdir())
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
