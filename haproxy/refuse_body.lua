-- Answers 413 to a request whose body is over HAPROXY_MAX_BODY_BYTES, after
-- reading and discarding the rest of the body. Answered at once, the client
-- would still be sending when HAProxy closes the connection; the kernel then
-- resets it, and most HTTP clients (they send the whole body before reading)
-- see a reset instead of the 413. nginx's lingering_close does the same.
-- Nothing is kept: at most one read's worth of the body is in memory.

-- Past this much, stop reading and close: a client that sends more is not
-- owed an answer, and HAProxy's time is better spent elsewhere.
local DISCARD_AT_MOST = 64 * 1024 * 1024
-- haproxy.cfg's limit, named in the answer (digits only: it goes into JSON as it is).
local LIMIT = os.getenv("HAPROXY_MAX_BODY_BYTES") or ""
if not LIMIT:match("^%d+$") then
    LIMIT = "1048576"
end

core.register_service("refuse_large_body", "http", function(applet)
    local discarded = 0
    while discarded < DISCARD_AT_MOST do
        local chunk = applet:receive(65536)
        if chunk == nil or chunk == "" then
            break
        end
        discarded = discarded + #chunk
    end
    -- A JSON-RPC error, as the replica's own 413 for a chunked body (mcp_ha/limits.py):
    -- a client gets the same answer whichever of the two refused it.
    local body = '{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Request body over '
        .. LIMIT .. ' bytes"}}'
    applet:set_status(413)
    applet:add_header("content-type", "application/json")
    applet:add_header("content-length", tostring(#body))
    applet:add_header("connection", "close")
    applet:start_response()
    applet:send(body)
end)
