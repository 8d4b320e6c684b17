"""`loraplex admin billing` against an embedded SQLite database."""

from __future__ import annotations

import csv
import io
import json
import uuid
from datetime import UTC, datetime

from click.testing import CliRunner

from loraplex.cli import main


def _run(args, env):
    result = CliRunner().invoke(main, ["admin", *args], env=env, catch_exceptions=False)
    return result


def test_prices_statement_report_and_finalize_from_the_command_line(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    assert _run(["create-tenant", "acme"], env).exit_code == 0
    r = _run(["billing", "set-price", "--prompt", "1.5", "--completion", "3", "--surcharge", "0.25",
              "--from", "2026-10"], env)
    assert r.exit_code == 0, r.output
    bad = _run(["billing", "set-price", "--prompt", "0.1234567", "--completion", "1"], env)
    assert bad.exit_code != 0 and "more than 6 decimals" in bad.output
    bad = _run(["billing", "set-price", "--prompt", "1", "--completion", "1", "--currency", "xyz"], env)
    assert bad.exit_code != 0 and "ISO 4217" in bad.output and "'XYZ'" in bad.output

    from loraplex.config import Settings
    from loraplex.platform.db import make_engine, make_session_factory, session_scope
    from loraplex.platform.models import Tenant, UsageRecord

    engine = make_engine(Settings(data_dir=tmp_path).resolved_database_url)
    with session_scope(make_session_factory(engine)) as s:
        tenant = s.query(Tenant).one()
        for adapter in (None, "sql"):
            s.add(UsageRecord(request_id=uuid.uuid4().hex, tenant_id=tenant.id, api_key_id=1, model="m",
                              adapter_name=adapter, adapter_version="c" * 64 if adapter else None, endpoint="chat",
                              prompt_tokens=1_000_000, completion_tokens=500_000, ttft_ms=1, latency_ms=2, status="ok",
                              created_at=datetime(2026, 10, 3, tzinfo=UTC)))
    engine.dispose()

    statement = _run(["billing", "statement", "acme", "2026-10", "--format", "json"], env)
    body = json.loads(statement.output)
    # 2M prompt x 1.5 + 1M completion x 3 + 1.5M adapter tokens x 0.25
    assert body["total_amount"] == 3_000_000 + 3_000_000 + 375_000 and body["status"] == "draft"
    final = _run(["billing", "finalize", "2026-10"], env)
    assert final.exit_code == 0 and "1 statements" in final.output
    again = json.loads(_run(["billing", "statement", "acme", "2026-10", "--format", "json"], env).output)
    assert again["status"] == "final" and again["total_amount"] == body["total_amount"]
    report = _run(["billing", "report", "--start", "2026-10-01", "--end", "2026-10-31", "--group-by", "tenant,adapter"],
                  env)
    rows = list(csv.DictReader(io.StringIO(report.output)))
    assert [(r["tenant"], r["adapter"], r["prompt_tokens"]) for r in rows] == [
        ("acme", "", "1000000"), ("acme", "sql@cccccccccccc", "1000000")]
    rolled = _run(["billing", "rollup", "2026-10-03"], env)
    assert rolled.output.strip() == "2026-10-03: 2 rows"
    assert _run(["billing", "finalize", "2999-01"], env).exit_code != 0


def test_a_month_not_yet_closed_is_refused_even_with_no_tenant(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    r = _run(["billing", "finalize", "2999-01"], env)
    assert r.exit_code != 0 and "not closed yet" in r.output, r.output


def test_ids_past_the_database_and_odd_digits_name_no_tenant(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    for args in (["list-keys", "99999999999999999999999"], ["create-key", "99999999999999999999999"],
                 ["list-keys", "\u00b2"], ["billing", "statement", "99999999999999999999999", "2026-10"]):
        r = _run(args, env)
        assert r.exit_code != 0 and "no tenant" in r.output, (args, r.output)
    r = _run(["revoke-key", "99999999999999999999999"], env)
    assert r.exit_code != 0 and "no key has id 99999999999999999999999" in r.output, r.output


def test_an_admin_key_name_the_column_cannot_hold_is_a_usage_error(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    for name in ("n" * 65, ""):
        r = _run(["create-admin-key", "--name", name], env)
        assert r.exit_code == 2 and "a key name is 1-64 characters" in r.output, r.output
    made = _run(["create-admin-key", "--name", "n" * 64], env)
    assert made.exit_code == 0 and made.output.strip().splitlines()[-1].startswith("lpx_admin_"), made.output


def test_an_empty_report_still_has_its_header(tmp_path):
    """No usage in the range: the CSV is its header line, which scripts and spreadsheets read as empty, not a
    file with nothing in it."""
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    r = _run(["billing", "report", "--start", "2026-01-01", "--end", "2026-01-31", "--group-by", "tenant,adapter"],
             env)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == ("tenant_id,tenant,adapter,requests,failed_requests,prompt_tokens,completion_tokens,"
                                "total_tokens,avg_latency_ms,amount,currency,amounts")


def test_an_empty_usage_csv_still_has_its_header(client, make_tenant):
    tenant = make_tenant()
    r = client.get("/v1/usage", headers=tenant.headers, params={"format": "csv"})
    assert r.status_code == 200
    assert r.text.strip().startswith("date,") and len(r.text.strip().splitlines()) == 1


def test_no_statement_for_a_month_before_the_tenant_existed_or_not_begun(tmp_path):
    """As the tenant API answers 404: a month before the tenant (with no usage in it) or one that has not
    begun has no statement, rather than an empty draft."""
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    assert _run(["create-tenant", "acme"], env).exit_code == 0
    before = CliRunner().invoke(main, ["admin", "billing", "statement", "acme", "2020-01"], env=env)
    assert before.exit_code != 0 and "did not exist then" in before.output and "Traceback" not in before.output
    later = CliRunner().invoke(main, ["admin", "billing", "statement", "acme", "2999-01"], env=env)
    assert later.exit_code != 0 and "has not begun" in later.output
    this_month = datetime.now(UTC).strftime("%Y-%m")
    assert _run(["billing", "statement", "acme", this_month], env).exit_code == 0
    listed = _run(["list-tenants"], env).output
    assert "monthly_tokens=" in listed


def test_prices_are_plain_decimal_numbers_on_the_command_line(tmp_path):
    """An exponent made Decimal overflow (a traceback); NaN, signs and other spellings are refused by name."""
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    assert _run(["create-tenant", "acme"], env).exit_code == 0
    for value in ("1e999999", "1E5", "NaN", "Infinity", "-0", "-1", "1_000", "9" * 200):
        for args in (["set-price", "--prompt", value, "--completion", "1"],
                     ["set-price", "--prompt", "1", "--completion", "1", "--surcharge", value],
                     ["set-tenant-price", "acme", "--completion", value]):
            r = _run(["billing", *args], env)
            assert r.exit_code == 2, (args, r.output)
            assert "plain decimal number" in r.output or "without a sign" in r.output or "too long" in r.output, \
                (args, r.output)
            assert "Traceback" not in r.output
    ok = _run(["billing", "set-price", "--prompt", "0.25", "--completion", "1.", "--surcharge", ".5"], env)
    assert ok.exit_code == 0, ok.output


def test_report_and_rollup_days_are_yyyy_mm_dd_only(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    for value in ("2026-1-1", "20260101", "1767225600", "2026-01-01T00:00:00", "2026-01-01 00:00"):
        for args in (["report", "--start", value], ["report", "--end", value], ["rollup", value]):
            r = _run(["billing", *args], env)
            assert r.exit_code == 2 and "YYYY-MM-DD" in r.output, (args, r.output)
    r = _run(["billing", "report", "--start", "2026-02-01", "--end", "2026-01-01"], env)
    assert r.exit_code == 2 and "2026-02-01 is after end 2026-01-01" in r.output, r.output
    r = _run(["billing", "report", "--group-by", "tenant,tenant", "--start", "2026-01-01", "--end", "2026-01-02"], env)
    assert r.exit_code == 0 and r.stdout.splitlines()[0].split(",")[:3] == ["tenant_id", "tenant", "requests"], r.output
    r = _run(["billing", "report", "--group-by", "tenant,weekday"], env)
    assert r.exit_code == 2 and "weekday" in r.output, r.output
    r = _run(["billing", "report", "--adapter", "nope"], env)
    assert r.exit_code == 1 and "There is no adapter 'nope'" in r.output, r.output
    assert _run(["create-tenant", "acme"], env).exit_code == 0
    r = _run(["billing", "report", "--adapter", "nope", "--tenant", "acme"], env)
    assert r.exit_code == 1 and "the tenant has no adapter" in r.output and "you have" not in r.output, r.output
    r = _run(["billing", "report", "--adapter", "nope@xyz"], env)
    assert r.exit_code == 2 and "hex digits" in r.output, r.output
    assert _run(["billing", "report", "--adapter", ""], env).exit_code == 0


def test_json_output_ends_its_line(tmp_path):
    """JSON came out without a final line break: the shell's prompt followed on its last line."""
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENVIRONMENT": "test"}
    assert _run(["create-tenant", "acme"], env).exit_code == 0
    report = _run(["billing", "report", "--format", "json"], env)
    assert report.exit_code == 0 and report.stdout == "[]\n", report.output
    period = f"{datetime.now(UTC):%Y-%m}"
    statement = _run(["billing", "statement", "acme", period, "--format", "json"], env)
    assert statement.stdout.endswith("}\n") and not statement.stdout.endswith("\n\n"), statement.output
    csv_report = _run(["billing", "report"], env)
    assert not csv_report.stdout.endswith("\n\n")
