"""Pattern: SSE streams that resume on any replica.

A session-era (2025-11-25) call answers over an SSE stream: a priming event,
progress and logs, then the result, each event with an id. When the
connection breaks, the client reconnects with `GET /mcp` and `Last-Event-ID`
(the last id it got), and the server replays what came after. The MCP SDK
does this through an `EventStore`, to which each transport writes every
outgoing message before sending it. FastMCP, though, gives each transport a
randomly prefixed view of its store, so a stream resumes only on the replica
that sent it; and without a store (as this kit had) it resumes nowhere.

Here:

1. every event of a session goes to the session's event log in the shared
   store (`SessionStore.add_event`: one Redis list per session, bounded by
   count and kept a few minutes after its latest event), so every replica
   can read it. `SessionEvents` is the SDK's
   `EventStore` bound to one session; `adoption.py` gives one to the
   transport of every session a replica opens or adopts (`_sdk.py`
   does the reaching into the SDK);
2. a replay *follows* the stream in the store until the stream's final event
   (the call's response), rather than sending what is stored so far. After a
   replay the SDK forwards only what its own transport produces, and when the
   call runs on another replica its later events reach this one only through
   the store. When the call runs on this replica, its live messages go to the
   broken connection's stream or, once that is gone, nowhere (the SDK stores
   a message first, then drops it when no stream waits for it), never to the
   resumed one. So following the store delivers each event exactly once in
   both cases. The replay then ends the response: it returns no stream id,
   because with one the SDK would attach a live stream to the response, which
   after the final event never ends, and before it sends what the store
   already delivers;
3. `CheckResumption` (ASGI middleware) answers a bad `Last-Event-ID` before
   the SDK opens a 200 stream: 400 for a malformed id, 404 for an id this
   session has no event under (unknown, expired, trimmed or another
   session's: one answer for all, revealing nothing), 503 when the store
   cannot be reached. With authentication on (`principals.py`), a session another
   principal opened gets that same 404, and a request the auth layer will
   refuse passes untouched to get its 401, having read nothing.

Bounded (issue: nothing one client sends takes what all share):

- an event over `max_event_bytes` (MAX_EVENT_BYTES) is sent live but not
  kept: a call's answer is kept as a short error saying to call again, so a
  resumed stream still ends; a stream whose id (the request's id) is over
  `MAX_STREAM_ID_BYTES` is not kept at all. The store bounds each session's
  log in bytes too (MAX_SESSION_LOG_BYTES);
- a waiting replay does not poll: it sleeps until the store says an event
  was added to its own stream (`EventFeed`, one subscription per replica
  while any replay waits), then reads only what was added after the last
  event it read (`SessionStore.stream_since`), however long the log. The
  replays of a quiet call share one check per `RUNNER_CHECK_SECONDS` per
  replica that its replica still runs it (`Runs.alive`), and one mark every
  third of `abandoned_seconds` that someone reads its stream;
- `CheckResumption` lets at most `max_per_session` replays run per session
  (429) and `max_replays` per replica (503), both with Retry-After;
- a call nobody reads is cancelled: once its client's connection has closed
  (`_sdk.py` tells `SessionEvents.unread`), the call holds its session on
  its replica until it answers, and if no replay on any replica has read its
  stream for `abandoned_seconds` (ABANDONED_CALL_SECONDS), it is cancelled
  as its client's `notifications/cancelled` would, its stream ending with the
  SDK's "Request cancelled" error;
- a call's re-run record (its request, up to `MAX_RERUN_REQUEST_BYTES`) is
  dropped as soon as the call's answer is in the log.

A 2026-07-28 (sessionless) call has no event log and cannot resume: it ends
with its stream, whose closing is how the client cancels it. When its replica
dies, the TypeScript client would still wait out its request timeout (60 s),
as it learns of a cut only by reconnecting, and reconnects only to a stream
whose events carry ids. So `CutCalls` opens each such streamed call with a
priming event whose id names the request (`CUT_MARK`), and `CheckResumption`
answers the reconnecting GET, on any replica and without the store, with a
JSON-RPC error for that request: the call is not running, a retry is safe
(`data: {"retryable": true}`), and its idempotency key makes it apply once.

Resuming reads a stream and takes nothing over: a replica asked to replay a
session it does not hold serves it without advancing the session's ownership
epoch (`adoption.py`), so the call still running on its owner can
finish and write its result, and the resumed stream delivers that result.

One job per module:

- `event_store.py`: `SessionEvents`, the SDK's event store over one
  session's log: storing, replaying and following a stream, and finding a
  call whose runner is gone;
- `feed.py`: `EventFeed`, which wakes the replays waiting on a stream;
- `lease.py`: `Runs`, this replica's lease, and whether another's lapsed;
- `reruns.py`: `Reruns`, how a call whose runner is gone is run again here;
- `resumption.py`: `CheckResumption`, the check in front of a resuming GET;
- `cut.py`: `CutCalls`, the 2026-07-28 calls whose stream is cut.
"""
