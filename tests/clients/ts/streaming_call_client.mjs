// The official MCP TypeScript SDK v1 (@modelcontextprotocol/sdk, pinned in package.json) making one
// streamed call, for tests/clients/test_streaming_failover.py: `Client` over
// `StreamableHTTPClientTransport`, both at their defaults (session-era `initialize`, the SDK's own
// request timeout and SSE reconnection, no retries of ours).
//
//   node streaming_call_client.mjs <mcp-url> <num-items>
//
// Opens a session, calls `increment_counter` once (the session's replica is in its answer), then
// `analyze_data` with <num-items> and a progress handler, so the call streams. Whatever becomes of
// the call's stream (its replica killed, say) is the SDK's to deal with: this script only waits for
// the call's outcome. Then it reads the session's summary resource through the same client, closes
// the session and exits 0.
//
// stdout, one JSON object per line, each as it happens:
//   {"type":"pinned","session_id":"...","counter":1,"instance":"mcp-server-2"}
//   {"type":"progress","progress":3,"total":60}
//   {"type":"transport_error","error":"..."}     what the SDK reports to Client.onerror, if anything
//   {"type":"result","ok":true,"structured":{...},"error":null}
//   {"type":"summary","summary":{...},"error":null}
//   {"type":"done"}
// Exit status: 0 when it got that far, 1 with a message on stderr otherwise (2: usage).
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { errorText as describe, failer, line, sleep, structured } from './common.mjs';

const fail = failer('streaming_call_client.mjs');
const errorText = error => describe(error, 500);

const CLOSE_BOUND_MS = 5000;

async function main(url, items) {
    const client = new Client({ name: 'streaming-failover-ts-sdk', version: '0.0.0' });
    const transport = new StreamableHTTPClientTransport(new URL(url));
    await client.connect(transport);
    // Set after connect (which wires the transport to the client): reports only, changes nothing.
    client.onerror = error => line({ type: 'transport_error', error: errorText(error) });

    const pinned = structured(await client.callTool({ name: 'increment_counter', arguments: {} }), 'increment_counter');
    line({ type: 'pinned', session_id: transport.sessionId ?? null, counter: pinned.counter, instance: pinned.instance });

    const outcome = { type: 'result', ok: false, structured: null, error: null };
    try {
        const result = await client.callTool({ name: 'analyze_data', arguments: { num_items: items } }, undefined, {
            onprogress: ({ progress, total }) => line({ type: 'progress', progress, total: total ?? null })
        });
        outcome.structured = structured(result, 'analyze_data');
        outcome.ok = true;
    } catch (error) {
        outcome.error = errorText(error);
    }
    line(outcome);

    const summary = { type: 'summary', summary: null, error: null };
    try {
        const read = await client.readResource({ uri: `resource://session/${transport.sessionId}/summary` });
        summary.summary = JSON.parse(read.contents[0].text);
    } catch (error) {
        summary.error = errorText(error);
    }
    line(summary);
    line({ type: 'done' });
    // Ending the session (DELETE) is housekeeping: bounded, and its failure is not reported.
    await Promise.race([client.close().catch(() => {}), sleep(CLOSE_BOUND_MS)]);
}

const args = process.argv.slice(2);
const items = Number(args[1]);
if (args.length !== 2 || !Number.isInteger(items) || items < 0) {
    fail('usage: node streaming_call_client.mjs <mcp-url> <num-items>', 2);
}
try {
    await main(args[0], items);
    process.exit(0);
} catch (error) {
    fail(error?.stack ?? String(error));
}
