-- Answers 413 to a request whose body is over HAPROXY_MAX_BODY_BYTES, after
-- reading and discarding the rest of the body. Answered at once, the client
-- would still be sending when HAProxy closes the connection; the kernel then
-- resets it, and most HTTP clients (they send the whole body before reading)
-- see a reset instead of the 413. nginx's lingering_close does the same.
-- Nothing is kept: at most one read's worth of the body is in memory.

-- Past this much, stop reading and close: a client that sends more is not
-- owed an answer, and HAProxy's time is better spent elsewhere.
local DISCARD_AT_MOST = 64 * 1024 * 1024

core.register_service("refuse_large_body", "http", function(applet)
    local discarded = 0
    while discarded < DISCARD_AT_MOST do
        local chunk = applet:receive(65536)
        if chunk == nil or chunk == "" then
            break
        end
        discarded = discarded + #chunk
    end
    local body = "request body too large\n"
    applet:set_status(413)
    applet:add_header("content-type", "text/plain")
    applet:add_header("content-length", tostring(#body))
    applet:add_header("connection", "close")
    applet:start_response()
    applet:send(body)
end)
