"""Session affinity (router/policy.py SessionAffinity): a session's turns stay on its worker
by exact id, whatever the inner policy prefers; a new session, or one whose worker is gone,
is placed by the inner policy and bound there; the binding yields past a load bound. Plain
Python, no I/O."""

from __future__ import annotations

from tandem.router.policy import (
    LeastLoad,
    PrefixAware,
    RouteRequest,
    SessionAffinity,
    WorkerState,
    build_policy,
    session_of,
)


def workers(*loads: int) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", running=load) for i, load in enumerate(loads)]


def turn(policy, pool, session: str | None, text: str = "hello") -> WorkerState:
    request = RouteRequest(text, session)
    chosen = policy.rank(pool, request)[0]
    policy.routed(chosen, request)
    return chosen


def test_a_sessions_turns_stay_on_its_worker_while_the_inner_policy_would_move_them():
    policy, pool = SessionAffinity(LeastLoad()), workers(0, 0, 0)
    home = turn(policy, pool, "agent-1")
    for _ in range(4):  # up to the load bound (2 x 0 + 4)
        home.running += 1  # least load alone would pick another worker each time
        assert turn(policy, pool, "agent-1") is home
    assert turn(policy, pool, None) is not home  # requests without a session: the inner policy


def test_session_ids_match_exactly_never_by_prefix():
    policy, pool = SessionAffinity(LeastLoad()), workers(0, 0)
    first = turn(policy, pool, "session-1")
    first.running += 3
    assert turn(policy, pool, "session-12") is not first
    assert policy.worker_of("session-12") != policy.worker_of("session-1")


def test_a_session_whose_worker_is_gone_is_placed_again_and_rebound():
    policy, pool = SessionAffinity(LeastLoad()), workers(0, 5, 9)
    assert turn(policy, pool, "s").id == "w0"
    alive = pool[1:]  # w0 is ejected: not among the healthy workers the pool hands over
    assert turn(policy, alive, "s").id == "w1" and policy.worker_of("s") == "w1"
    policy.forget("w1")  # removed or restarted: its bindings go too
    assert policy.worker_of("s") is None


def test_affinity_yields_once_its_worker_is_too_loaded():
    policy, pool = SessionAffinity(LeastLoad(), max_load_ratio=2.0, slack=4), workers(0, 0)
    home = turn(policy, pool, "s")
    home.running = 4  # 4 <= 2 * 0 + 4: still home
    assert turn(policy, pool, "s") is home
    home.running = 5  # past the bound: the least loaded takes it, and keeps it
    moved = turn(policy, pool, "s")
    assert moved is not home and policy.worker_of("s") == moved.id


def test_the_wrapper_exposes_the_inner_policys_estimates():
    policy = build_policy("prefix_aware")
    assert isinstance(policy, SessionAffinity) and isinstance(policy.inner, PrefixAware)
    pool = workers(0, 0)
    turn(policy, pool, None, "a long shared prompt " * 20)
    turn(policy, pool, None, "a long shared prompt " * 20)
    assert policy.matched_chunks > 0 and policy.reads_text


def test_a_request_names_its_session_as_the_server_reads_it():
    assert session_of({"session_id": "a"}, {}) == "a"
    assert session_of({"session_params": {"id": "b"}}, {}) == "b"
    assert session_of({}, {"x-session-id": "c"}) == "c"
    assert session_of({"session_id": 5}, {}) is None and session_of(None, {}) is None
