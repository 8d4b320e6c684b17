"""`loraplex serve`, `loraplex worker`, `loraplex engine`, `loraplex migrate` and `loraplex admin`."""

from __future__ import annotations

import click

from loraplex.config import masked_url
from loraplex.platform.admin_cli import admin
from loraplex.platform.db_errors import database_error, sqlite_path_problem
from loraplex.resources import make_folder

__all__ = ["admin", "engine", "migrate", "serve", "worker"]


def _settings(**overrides):
    from pydantic import ValidationError

    from loraplex.config import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise click.ClickException("; ".join(_setting_error(e) for e in exc.errors())) from exc


def _setting_error(error: dict) -> str:
    """One settings error, naming the setting and its environment variable when it is about one field."""
    msg = error["msg"].removeprefix("Value error, ")
    if not error.get("loc"):
        return msg  # a check across settings: its message names them
    name = str(error["loc"][0])
    value = error.get("input")
    if isinstance(value, str) and name.endswith("_url"):
        value = masked_url(value)
    return f"{name} (LORAPLEX_{name.upper()}): {msg}; got {value!r}"


MIGRATE_COMMAND = "loraplex migrate"


def prepare_database_or_fail(settings, *, migrate: bool | None = None) -> None:
    """Create or upgrade the database (migrate=None: as LORAPLEX_AUTO_MIGRATE says), or stop with one line
    saying what stood in the way; not migrating, stop with one line if the database is behind this version."""
    from sqlalchemy.exc import OperationalError

    from loraplex.platform.bootstrap import prepare_database
    from loraplex.platform.migrate import pending_upgrade

    url = settings.resolved_database_url
    migrate = settings.auto_migrate if migrate is None else migrate
    if migrate and url.startswith("sqlite") and settings.database_url is None:
        _make_data_dir(settings.data_dir)
    try:
        if migrate:
            prepare_database(settings)
            return
        behind = pending_upgrade(url)
    except Exception as exc:  # unreachable, not a database, or a migration that refused: said in one line
        verb = "reach" if isinstance(exc, OperationalError) else "prepare"
        # SQLite says only "unable to open database file": say which path, and what is wrong with it
        problem = sqlite_path_problem(url) if isinstance(exc, OperationalError) else None
        if problem:
            where = "LORAPLEX_DATABASE_URL" if settings.database_url else "under LORAPLEX_DATA_DIR"
            raise click.ClickException(f"cannot open the database {masked_url(url)} ({where}): {problem}") from exc
        raise click.ClickException(f"cannot {verb} the database {masked_url(url)}: {database_error(exc)}") from exc
    if behind is not None:
        current, head = behind
        at = f"is at revision {current}" if current else "has not been migrated"
        raise click.ClickException(f"the database {masked_url(url)} {at}, this version of loraplex needs {head}, "
                                   f"and LORAPLEX_AUTO_MIGRATE is false: run `{MIGRATE_COMMAND}` first")


@click.command()
def migrate():
    """Create or upgrade the database to this version's schema (what `loraplex serve` does on start unless
    LORAPLEX_AUTO_MIGRATE is false), then exit."""
    settings = _settings()
    prepare_database_or_fail(settings, migrate=True)
    click.echo(f"loraplex migrate: the database {masked_url(settings.resolved_database_url)} is up to date",
               err=True)


def refuse_another_key_secret(settings) -> None:
    """Stop, in one line, a process whose LORAPLEX_SECRET_KEY is not the one the database's keys were made with."""
    from loraplex.platform.bootstrap import key_secret_problem

    try:
        problem = key_secret_problem(settings)
    except Exception as exc:
        raise click.ClickException(f"cannot reach the database {masked_url(settings.resolved_database_url)}: "
                                   f"{database_error(exc)}") from exc
    if problem:
        raise click.ClickException(problem)


def _make_data_dir(data_dir) -> None:
    try:
        make_folder(data_dir)
    except OSError as exc:
        raise click.ClickException(f"cannot use the data folder {data_dir} (LORAPLEX_DATA_DIR or --data-dir): "
                                   f"{exc.strerror}") from exc


def _print_admin_key(secret: str) -> None:
    bar = "=" * 78
    click.echo(f"\n{bar}\nloraplex created the admin key. It is shown only this once; keep it somewhere safe:\n\n"
               f"    {secret}\n\nUse it for /admin/api (Authorization: Bearer ...) and to sign in at /console.\n"
               f"{bar}\n", err=True)


def _refuse_busy_port(host: str, port: int) -> None:
    """uvicorn binds only after the database, the one-time admin key and the model are ready, so a busy port
    would show after all of them (and after the key was printed into the failed run's output)."""
    _listen(host, port).close()


def _listen(host: str, port: int):
    """A socket listening on host:port, or one line saying why there can be none."""
    import errno
    import socket

    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            listener.bind(address)
            listener.listen(2048)  # a bound socket that does not listen yet would not keep a second bind out
        except BaseException:
            listener.close()
            raise
    except OSError as exc:
        if isinstance(exc, socket.gaierror):  # the host is no address of this machine's, nor a name it knows
            hint = "pass --host an address of this machine (127.0.0.1, 0.0.0.0)"
        elif exc.errno == errno.EADDRINUSE:
            hint = "pass --port (or --host), or stop what holds it"
        else:
            hint = "pass another --host or --port"
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}; {hint}") from exc
    return listener


def _refuse_unreachable_redis(settings) -> None:
    """Quotas, tasks and the engine registry all live in Redis: a server that cannot reach it would fail its
    startup with a connection traceback (the API) or serve without being found (an engine)."""
    import redis

    from loraplex.platform.redis_clients import sync_redis

    url = settings.redis_url
    try:
        client = sync_redis(settings, retries=0)  # a probe: one try, within the connect timeout
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        from loraplex.platform.outage import error_text

        raise click.ClickException(f"cannot reach Redis at {masked_url(url)} (LORAPLEX_REDIS_URL): "
                                   f"{error_text(exc)}") from exc


@click.command()
@click.option("--model", default=None, help="base model: local HF folder, .gguf file, Hub id or 'smollm2-135m'")
@click.option("--host", default=None, help="address to listen on (default 127.0.0.1)")
@click.option("--port", default=None, type=click.IntRange(0, 65535), help="port (default 8000)")
@click.option("--data-dir", default=None, type=click.Path(file_okay=False), help="where SQLite and adapters live")
@click.option("--no-engine", is_flag=True, help="API only: route inference to `loraplex engine` processes")
def serve(model, host, port, data_dir, no_engine):
    """Serve the API (and, by default, the engine in the same process)."""
    from loraplex.platform.cpu_threads import prefer_passive_openmp

    prefer_passive_openmp()  # before the engine imports torch
    import uvicorn

    from loraplex.platform.app import create_app
    from loraplex.platform.bootstrap import ensure_admin_key

    settings = _settings(model=model, host=host, port=port, data_dir=data_dir,
                         embedded_engine=False if no_engine else None)
    if no_engine and not settings.redis_url:
        raise click.ClickException("--no-engine needs LORAPLEX_REDIS_URL: engines register themselves in Redis")
    _refuse_busy_port(settings.host, settings.port)
    if settings.redis_url:
        _refuse_unreachable_redis(settings)
    prepare_database_or_fail(settings)
    refuse_another_key_secret(settings)
    if settings.embedded_engine:
        _refuse_bad_model(settings)
    secret = ensure_admin_key(settings)
    if secret:
        _print_admin_key(secret)
    database = "SQLite" if settings.resolved_database_url.startswith("sqlite") else "PostgreSQL"
    tasks = "in-process tasks" if settings.tasks_eager else "Celery tasks via Redis (run `loraplex worker`)"
    engine_where = "engine in this process" if settings.embedded_engine else "engines from `loraplex engine`"
    click.echo(f"loraplex: {database}, {tasks}, {engine_where}; model {settings.model}; "
               f"http://{settings.host}:{settings.port}", err=True)
    app = create_app(settings)
    if settings.redis_url and settings.embedded_engine:
        from loraplex.platform.engine_worker import consume_engine_queue_with_app

        consume_engine_queue_with_app(app)
    from loraplex.platform.http_protocol import http_protocol_class

    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            http=http_protocol_class(), timeout_keep_alive=settings.keep_alive_timeout,
                            # a backstop for what stop_requests cannot end (a request whose body never came)
                            timeout_graceful_shutdown=settings.shutdown_timeout + 5)
    from loraplex.platform.stopping import StoppingServer

    StoppingServer(config, app.state.services, settings.shutdown_timeout).run()


def _refuse_unreachable_database(settings, *, tables: tuple[str, ...] = (), why: str = "") -> None:
    """Every task reads or writes the database: a worker that cannot reach it would take tasks off the queue
    only to fail them. `tables` are ones the process reads from its first moment (a database the API has
    migrated); `why` ends the error, saying what the process needs the database for."""
    from sqlalchemy import inspect, text

    from loraplex.platform.db import make_engine

    url = settings.resolved_database_url
    where = f"the database {masked_url(url)} (LORAPLEX_DATABASE_URL)"
    missing_file = _missing_sqlite_file(url)
    if missing_file:  # connecting would create it: an empty file left behind in a data directory others share
        problem = sqlite_path_problem(url)
        detail = problem if problem and "folder" in problem else f"no file {missing_file}"
        raise click.ClickException(f"{where} does not exist ({detail}): not the platform's "
                                   f"database, or one `loraplex serve` has not created yet{why}")
    try:
        engine = make_engine(url, pooled=False)
        try:
            with engine.connect() as connection:
                connection.execute(text("SELECT 1"))
                missing = [table for table in tables if not inspect(connection).has_table(table)]
        finally:
            engine.dispose()
    except Exception as exc:
        reason = sqlite_path_problem(url) or database_error(exc)
        raise click.ClickException(f"cannot reach {where}: {reason}{why}") from exc
    if missing:
        raise click.ClickException(f"{where} has no platform tables (no {missing[0]}): not the platform's "
                                   f"database, or one `loraplex serve` has not migrated yet{why}")


def _missing_sqlite_file(url: str) -> str | None:
    """The path of a SQLite URL's file when that file does not exist (SQLite creates it on connect)."""
    from pathlib import Path

    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or not path or path == ":memory:" or path.startswith("file:"):
        return None
    return None if Path(path).exists() else path


def _refuse_bad_model(settings) -> None:
    """A model that cannot be served, or engine settings it cannot be served with (a context longer than the
    model's, a KV cache too small for one block), is a one-line error before any server starts (not a start-up
    traceback)."""
    from loraplex.engine.errors import InvalidRequestError, ModelLoadError
    from loraplex.engine.llm_engine import check_model, derive_limits, resolve_device, resolve_dtype
    from loraplex.platform.engine_factory import engine_config

    try:
        _, arch = check_model(settings.model)
    except ModelLoadError as exc:
        raise click.ClickException(f"cannot serve the model: {exc}") from exc
    config = engine_config(settings)
    try:
        derive_limits(config, arch, resolve_dtype(config.dtype, resolve_device(config.device)), warn=False)
    except InvalidRequestError as exc:
        setting = f" (LORAPLEX_{exc.param.upper()})" if exc.param else ""
        raise click.ClickException(f"cannot serve the model {settings.model}: {exc}{setting}") from exc


@click.command()
@click.option("--queues", default=None, help="comma-separated Celery queues (default: LORAPLEX_TASK_QUEUE)")
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--pool", default="prefork", show_default=True, type=click.Choice(["prefork", "threads", "solo"]))
@click.option("--beat/--no-beat", default=True, show_default=True,
              help="also run the periodic tasks' scheduler (one worker at a time runs it; the others stand by)")
@click.option("--loglevel", default="info", show_default=True)
def worker(queues, concurrency, pool, beat, loglevel):
    """A Celery worker for background tasks (validation, warming, rollups). Needs LORAPLEX_REDIS_URL."""
    settings = _settings()
    if not settings.redis_url:
        raise click.ClickException("`loraplex worker` needs LORAPLEX_REDIS_URL (Redis is the task broker); "
                                   "the embedded `loraplex serve` runs tasks in-process without it")
    _refuse_unreachable_database(settings)
    from loraplex.platform.tasks.celery_app import configure

    app = configure(settings)
    argv = ["worker", f"--queues={queues or settings.task_queue}", f"--concurrency={concurrency}", f"--pool={pool}",
            f"--loglevel={loglevel}", "--without-gossip", "--without-mingle"]
    leader = None
    if beat:
        from loraplex.platform.tasks.beat import start_beat

        settings.data_dir.mkdir(parents=True, exist_ok=True)
        leader = start_beat(app, settings, str(settings.data_dir / "celerybeat-schedule"))
    try:
        app.worker_main(argv)
    finally:
        if leader is not None:
            leader.stop()


@click.command()
@click.option("--model", default=None, help="base model (default: LORAPLEX_MODEL)")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8100, show_default=True, type=click.IntRange(0, 65535))
@click.option("--advertise", default=None, help="URL API processes use to reach this engine (default http://HOST:PORT)")
def engine(model, host, port, advertise):
    """An engine process: holds the model, serves API processes, consumes its own task queue."""
    from loraplex.platform.cpu_threads import prefer_passive_openmp

    prefer_passive_openmp()  # before the engine imports torch; its server's event loop needs the CPU too
    from loraplex.platform.remote.server import run_engine_server

    settings = _settings(model=model)
    if not settings.redis_url:
        raise click.ClickException("`loraplex engine` needs LORAPLEX_REDIS_URL to register itself with the API")
    _refuse_unreachable_redis(settings)
    # its pin sync reads the platform's tables: on a database without them (the SQLite file an unset
    # LORAPLEX_DATABASE_URL falls back to) the engine would serve without ever getting its pins
    _refuse_unreachable_database(settings, tables=("adapter_versions",),
                                 why="; engine processes read adapter pins from the platform's database: set "
                                     "LORAPLEX_DATABASE_URL to the one the API processes use")
    # uvicorn starts the app (the engine, its registration, its task queue) before it binds: an engine on a
    # busy port would register another engine's address and take tasks, then fail. The port is taken here,
    # before the model loads, and handed to the server, so that two engines started on one port at the same
    # time cannot both get past a check of it
    listener = _listen(host, port)
    from loraplex.platform.remote.server import EngineStopped

    try:
        _refuse_bad_model(settings)
        run_engine_server(settings, host=host, port=port, advertise=advertise, listener=listener)
    except EngineStopped as exc:  # exit status 1: a supervisor that restarts on failure starts a new engine
        raise click.ClickException(f"{exc}; the server log has the cause") from exc
    finally:
        listener.close()
