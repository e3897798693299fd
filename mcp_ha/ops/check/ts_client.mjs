// The official MCP TypeScript SDK v1 (@modelcontextprotocol/sdk, pinned in node/package.json) as a stock
// client for the HA check (mcp_ha/ops/check/node.py): `Client` over `StreamableHTTPClientTransport`, both at
// their defaults (session-era `initialize`, the SDK's own request timeout and SSE reconnection, no
// retries of ours). The only addition is a `fetch` that reads the Mcp-Ha-Replica header of each answer.
//
//   node ts_client.mjs          (run from a folder whose node_modules holds the SDK)
//
// stdin, one JSON request per line; stdout, one JSON answer per line, {"re": <the request's id>, ...}:
//   {"id":1,"op":"open","url":"http://.../mcp"}       -> {"re":1,"ok":true,"session":0,"session_id":"...","replica":"..."}
//   {"id":2,"op":"call","session":0,"tool":"t","arguments":{},"progress":false,"bound_ms":6000}
//                                                       -> {"re":2,"ok":true,"result":{...},"replica":"..."}
//                                                          {"re":2,"ok":false,"error":"...","overran":false}
//   {"id":3,"op":"close","session":0}                  -> {"re":3,"ok":true}
// Requests are served concurrently. A call with no outcome within bound_ms is abandoned through the
// SDK's own AbortSignal (the check's bound, not a client setting) and answered "overran":true. When
// stdin ends, every session still open is closed and the script exits 0.
import { createInterface } from 'node:readline';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const CLOSE_BOUND_MS = 5000;
const sessions = new Map();
let next = 0;

const send = obj => process.stdout.write(JSON.stringify(obj) + '\n');
const errorText = error => `${error?.name ?? 'Error'}: ${error?.message ?? String(error)}`.slice(0, 300);

// The tool's answer as an object; a tool error (isError) raises.
function structured(result, tool) {
    if (result.isError) {
        const text = result.content?.find(block => block.type === 'text')?.text ?? JSON.stringify(result.content);
        throw new Error(`${tool} answered isError: ${text}`);
    }
    if (result.structuredContent && typeof result.structuredContent === 'object') return result.structuredContent;
    const text = result.content?.find(block => block.type === 'text')?.text;
    if (text === undefined) throw new Error(`${tool} returned no structured result`);
    return JSON.parse(text);
}

async function open(request) {
    const state = { replica: null };
    const seen = async (input, init) => {
        const response = await fetch(input, init);
        state.replica = response.headers.get('mcp-ha-replica') ?? state.replica;
        return response;
    };
    const client = new Client({ name: 'mcp-ha-check-ts-sdk', version: '0.0.0' });
    const transport = new StreamableHTTPClientTransport(new URL(request.url), { fetch: seen });
    await client.connect(transport);
    const number = next++;
    sessions.set(number, { client, transport, state });
    return { session: number, session_id: transport.sessionId ?? null, replica: state.replica };
}

async function call(request) {
    const session = sessions.get(request.session);
    if (!session) throw new Error(`no session ${request.session}`);
    const abort = new AbortController();
    let timer;
    const expired = new Promise(resolve => {
        timer = setTimeout(() => resolve('expired'), request.bound_ms);
    });
    const options = { signal: abort.signal };
    if (request.progress) options.onprogress = () => {};
    const pending = session.client.callTool({ name: request.tool, arguments: request.arguments }, undefined, options);
    pending.catch(() => {}); // once abandoned, its rejection is nobody's business
    try {
        const outcome = await Promise.race([pending.then(result => ({ result })), expired]);
        if (outcome === 'expired') {
            abort.abort(new Error('abandoned'));
            return { ok: false, overran: true, error: `TimeoutError: no outcome within ${request.bound_ms / 1000} s` };
        }
        return { ok: true, result: structured(outcome.result, request.tool), replica: session.state.replica };
    } finally {
        clearTimeout(timer);
    }
}

async function close(number) {
    const session = sessions.get(number);
    if (!session) return {};
    sessions.delete(number);
    const bounded = new Promise(resolve => setTimeout(resolve, CLOSE_BOUND_MS));
    const closing = (async () => {
        try {
            await session.transport.terminateSession();
        } catch {}
        await session.client.close();
    })();
    closing.catch(() => {});
    await Promise.race([closing, bounded]);
    return {};
}

const OPS = { open, call, close: request => close(request.session) };

async function serve(request) {
    try {
        const op = OPS[request.op];
        if (!op) throw new Error(`unknown op ${request.op}`);
        const answer = await op(request);
        send({ ok: true, ...answer, re: request.id });
    } catch (error) {
        send({ re: request.id, ok: false, error: errorText(error), overran: false });
    }
}

const lines = createInterface({ input: process.stdin });
const serving = new Set();
lines.on('line', text => {
    if (!text.trim()) return;
    let request;
    try {
        request = JSON.parse(text);
    } catch {
        process.stderr.write(`ts_client.mjs: not a JSON line: ${text.slice(0, 200)}\n`);
        return;
    }
    const done = serve(request);
    serving.add(done);
    done.finally(() => serving.delete(done));
});
lines.on('close', async () => {
    await Promise.allSettled([...serving]);
    await Promise.allSettled([...sessions.keys()].map(close));
    process.exit(0);
});
