"""The service's Redis clients ride out a Redis restart and a lost reply: a private redis-server of the test's
own (its own port, killed by its PID) is restarted between and during requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import subprocess
import time

import pytest

from loraplex.config import Settings
from loraplex.platform.quotas import QuotaLimits

LIMITS = QuotaLimits(requests_per_minute=100, tokens_per_minute=10**6, max_concurrent=10, monthly_token_budget=10**6)
T0 = 1_800_000_000.0

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server on this machine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A redis-server on its own port, without persistence: a restart loses its data, as a cache's would."""

    def __init__(self):
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(500):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                return
            time.sleep(0.01)
        raise RuntimeError("the private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _settings(url: str) -> Settings:
    return Settings(environment="test", redis_url=url)


def test_clients_are_built_with_timeouts_a_health_check_and_retries():
    from redis.exceptions import ConnectionError, TimeoutError

    from loraplex.platform.redis_clients import async_redis, sync_redis

    settings = Settings(environment="test", redis_url="redis://127.0.0.1:1/0", redis_connect_timeout=1.5,
                        redis_socket_timeout=4.0, redis_retries=3)
    for client in (async_redis(settings), sync_redis(settings)):
        kwargs = client.connection_pool.connection_kwargs
        assert (kwargs["socket_connect_timeout"], kwargs["socket_timeout"]) == (1.5, 4.0)
        assert kwargs["health_check_interval"] > 0
        retry = kwargs["retry"]
        assert retry._retries == 3 and {ConnectionError, TimeoutError} <= set(retry._supported_errors)


def test_a_redis_restart_between_requests_costs_no_request(private_redis):
    """A restart drops every pooled connection and the loaded scripts: the next request after Redis is back
    gets its answer, not an error."""
    from loraplex.platform.quotas.redis import RedisQuotaLimiter
    from loraplex.platform.redis_clients import async_redis

    async def scenario():
        client = async_redis(_settings(private_redis.url))
        limiter = RedisQuotaLimiter(client, prefix="t")
        try:
            await limiter.settle(await limiter.acquire(1, LIMITS, "before", 5, now=T0), 5)
            private_redis.stop()
            private_redis.start()
            r = await limiter.acquire(1, LIMITS, "after", 5, now=T0 + 1)
            await limiter.settle(r, 3)
            return await limiter.month_used(1, now=T0 + 2)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 3  # the restart lost the earlier count; this one is there once


def test_a_request_sent_while_redis_restarts_waits_for_it(private_redis):
    from loraplex.platform.quotas.redis import RedisQuotaLimiter
    from loraplex.platform.redis_clients import async_redis

    async def scenario():
        client = async_redis(_settings(private_redis.url))
        limiter = RedisQuotaLimiter(client, prefix="t")
        try:
            await limiter.settle(await limiter.acquire(1, LIMITS, "before", 5, now=T0), 5)
            private_redis.stop()
            loop = asyncio.get_running_loop()
            back = loop.call_later(0.3, private_redis.start)  # down when the request comes, back soon after
            r = await limiter.acquire(1, LIMITS, "during", 5, now=T0 + 1)
            back.cancel()
            await limiter.settle(r, 4)
            return await limiter.month_used(1, now=T0 + 2)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 4


class ReplyDropper:
    """A TCP proxy in front of Redis that, when told, passes the next command on and cuts the connection in
    place of its reply: the command ran, the client cannot know."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.drop_next_reply = False
        self.dropped = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src, dst, replies: bool) -> None:
            try:
                while data := await src.read(65536):
                    if replies and self.drop_next_reply:
                        self.drop_next_reply = False
                        self.dropped += 1
                        break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    async def close(self) -> None:
        self.server.close()


def test_a_quota_reservation_whose_reply_was_lost_is_counted_once(private_redis):
    """The client sends the reservation again on a new connection after the first reply is lost; the script
    has run once already, and the second run must find the request admitted rather than count it twice."""
    from loraplex.platform.quotas.redis import RedisQuotaLimiter
    from loraplex.platform.redis_clients import async_redis

    async def scenario():
        proxy = ReplyDropper(private_redis.port)
        port = await proxy.start()
        client = async_redis(_settings(f"redis://127.0.0.1:{port}/0"))
        limiter = RedisQuotaLimiter(client, prefix="t")
        try:
            await limiter.settle(await limiter.acquire(1, LIMITS, "warm", 0, now=T0), 0)  # script loaded
            proxy.drop_next_reply = True
            r = await limiter.acquire(1, LIMITS, "lost-reply", 10, now=T0 + 1)
            assert proxy.dropped == 1
            counts = await client.mget("t:rl:1:req:" + str(int(T0 // 60)), "t:rl:1:tok:" + str(int(T0 // 60)))
            inflight = await client.zcard("t:rl:1:inflight")
            await limiter.settle(r, 7)
            month = await limiter.month_used(1, now=T0 + 2)
            return [int(c) for c in counts], inflight, month
        finally:
            await client.aclose()
            await proxy.close()

    (requests, tokens), inflight, month = asyncio.run(scenario())
    assert (requests, tokens, inflight) == (2, 10, 1)  # "warm" and "lost-reply", the latter's tokens once
    assert month == 7


def test_the_same_request_id_reserves_once():
    """What the lost-reply case comes down to, on the shared Redis: a second acquire of a request id in flight
    is answered as admitted and counts nothing."""
    from test_quotas import _redis_namespace

    from loraplex.platform.quotas.redis import RedisQuotaLimiter

    async def scenario():
        async with _redis_namespace() as (client, prefix):
            limiter = RedisQuotaLimiter(client, prefix=prefix)
            limits = QuotaLimits(requests_per_minute=1, tokens_per_minute=100, max_concurrent=1,
                                 monthly_token_budget=100)
            first = await limiter.acquire(1, limits, "r", 60, now=T0)
            again = await limiter.acquire(1, limits, "r", 60, now=T0)  # over every limit if counted twice
            await limiter.settle(first, 50)
            await limiter.settle(again, 50)  # the once-only settle guard
            return await limiter.used_now(1, now=T0)

    assert asyncio.run(scenario()) == (50, 50)


def test_a_redis_timeout_in_the_logs_names_its_setting(caplog):
    from redis.exceptions import TimeoutError as RedisTimeout

    from loraplex.platform.outage import OutageLog
    from loraplex.platform.redis_clients import async_redis

    async_redis(Settings(environment="test", redis_url="redis://127.0.0.1:1/0", redis_socket_timeout=4.5))
    outage = OutageLog(logging.getLogger("t"), "usage flush", 1.0)
    with caplog.at_level(logging.WARNING, logger="t"):
        outage.failed(RedisTimeout("Timeout reading from 127.0.0.1:6379"))
    assert "LORAPLEX_REDIS_SOCKET_TIMEOUT=4.5 s" in caplog.text


class SilentServer:
    """Accepts connections, reads what is sent, never answers: a hung Redis (a stopped process behind a live
    socket, a proxy whose upstream froze)."""

    def __init__(self):
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(65536):
                pass

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self.server.close()


def test_a_redis_that_never_answers_fails_a_command_within_the_deadline_not_the_retries():
    """Six retries of a 30 s socket timeout would hold the command for minutes; the deadline ends it, all
    retries included, as a redis TimeoutError naming the setting."""
    from redis.exceptions import TimeoutError as RedisTimeout

    from loraplex.platform.quotas.redis import RedisQuotaLimiter
    from loraplex.platform.redis_clients import async_redis, describe_timeout

    async def scenario():
        silent = SilentServer()
        port = await silent.start()
        settings = Settings(environment="test", redis_url=f"redis://127.0.0.1:{port}/0", redis_socket_timeout=30,
                            redis_retries=6, redis_deadline=0.3)
        client = async_redis(settings)
        limiter = RedisQuotaLimiter(client, prefix="t")
        started = time.monotonic()
        try:
            with pytest.raises(RedisTimeout) as raised:
                await limiter.acquire(1, LIMITS, "hung", 5, now=T0)
            return raised.value, time.monotonic() - started, silent.connections
        finally:
            await client.aclose()
            await silent.close()

    error, elapsed, connections = asyncio.run(scenario())
    assert "LORAPLEX_REDIS_DEADLINE=0.3 s" in str(error)
    assert describe_timeout(error) == "Redis deadline LORAPLEX_REDIS_DEADLINE=0.3 s"
    assert elapsed < 30  # not even one socket timeout: the deadline cut the first attempt
    assert connections == 1


def test_a_redis_restart_longer_than_one_retry_is_still_ridden_out_within_the_deadline(private_redis):
    """Connection refused for a second: the retries keep trying for as long as the deadline allows."""
    from loraplex.platform.quotas.redis import RedisQuotaLimiter
    from loraplex.platform.redis_clients import async_redis

    async def scenario():
        settings = Settings(environment="test", redis_url=private_redis.url, redis_retries=20, redis_deadline=30)
        client = async_redis(settings)
        limiter = RedisQuotaLimiter(client, prefix="t")
        try:
            await limiter.settle(await limiter.acquire(1, LIMITS, "before", 5, now=T0), 5)
            private_redis.stop()
            back = asyncio.get_running_loop().call_later(1.0, private_redis.start)
            r = await limiter.acquire(1, LIMITS, "during", 5, now=T0 + 1)
            back.cancel()
            await limiter.settle(r, 4)
            return await limiter.month_used(1, now=T0 + 2)
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == 4


def test_a_hung_redis_is_a_prompt_503_with_an_openai_error_body(private_redis, data_dir, make_tenant_factory):
    """The API's Redis stops answering (its process stopped: the socket still accepts): the next request is
    answered 503 within LORAPLEX_REDIS_DEADLINE, not after the retries' half a minute and more."""
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient
    from platform_helpers import make_settings

    settings = make_settings(data_dir, redis_url=private_redis.url, redis_deadline=0.5, redis_socket_timeout=30,
                             celery_task_always_eager=True)
    app, make = make_tenant_factory(settings, FakeEngine())
    body = {"model": "fake-base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(app) as client:
        tenant = make()
        assert client.post("/v1/chat/completions", headers=tenant.headers, json=body).status_code == 200
        private_redis.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            r = client.post("/v1/chat/completions", headers=tenant.headers, json=body)
            elapsed = time.monotonic() - started
        finally:
            private_redis.proc.send_signal(signal.SIGCONT)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "service_unavailable", error
    assert "retry" in error["message"] and r.headers["retry-after"]
    assert elapsed < 30  # within the deadline: not one socket timeout, let alone the retries
