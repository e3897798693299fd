// The official MCP TypeScript SDK v1 (@modelcontextprotocol/sdk, pinned in package.json) as a
// stock client under the failover benchmark (tools/failover_bench.py): `Client` over
// `StreamableHTTPClientTransport`, both at their defaults (session-era `initialize`, the SDK's
// own request timeout and SSE reconnection, no retries of ours).
//
//   node failover_client.mjs <mcp-url> <sessions> <bound-s> <think-min-s> <think-max-s> <max-calls>
//
// Opens <sessions> sessions and reads each one's counter once (a replica's first call pays for
// lazy set-up; that stays out of the figures), then prints {"type":"ready",...} and waits for a
// line "go" on stdin. From then on each session calls `increment_counter` in a loop, with a
// think time drawn from [think-min, think-max] between calls, until stdin is closed, or SIGTERM
// or SIGINT arrives, or it made <max-calls> calls. Once every loop has ended it reads each
// session's final counter (not a measured call: a few tries), prints those, closes the sessions
// and exits 0.
//
// stdout, one JSON object per line:
//   {"type":"ready","sessions":[{"session":0,"session_id":"..."},...]}
//   {"type":"call","session":0,"start":<epoch ms>,"duration":<ms>,"ok":true,"counter":7,
//    "instance":"mcp-server-2","error":null,"overran":false}
//   {"type":"stopped"}                                  every loop has ended
//   {"type":"final","session":0,"counter":41,"error":null}
//   {"type":"done"}
// A call fails when the SDK raises or the tool answers isError; one with no outcome within
// <bound-s> is the benchmark's to cut (measurement, not a client setting): it is abandoned
// through the SDK's own AbortSignal and counted failed, with "overran":true.
// Exit status: 0 when it got that far, 1 with a message on stderr otherwise (2: usage).
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { errorText as describe, failer, line, sleep, structured } from './common.mjs';

const fail = failer('failover_client.mjs');
const errorText = error => describe(error, 200);

const FINAL_READ_ATTEMPTS = 5;
const FINAL_READ_PAUSE_MS = 300;
const CLOSE_BOUND_MS = 5000;

const now = () => performance.timeOrigin + performance.now();

// `tool` on `client`, abandoned (AbortSignal) past `boundMs`: [outcome, overran].
async function bounded(client, tool, boundMs) {
    const abort = new AbortController();
    let timer;
    const expired = new Promise(resolve => {
        timer = setTimeout(() => resolve('expired'), boundMs);
    });
    const call = client.callTool({ name: tool, arguments: {} }, undefined, { signal: abort.signal });
    call.catch(() => {}); // once abandoned, its rejection is nobody's business
    try {
        const outcome = await Promise.race([call.then(result => ({ result })), expired]);
        if (outcome === 'expired') {
            const error = new Error(`no outcome within ${boundMs / 1000} s (the benchmark's bound)`);
            abort.abort(error);
            throw Object.assign(error, { name: 'TimeoutError', overran: true });
        }
        return structured(outcome.result, tool);
    } finally {
        clearTimeout(timer);
    }
}

async function main(url, sessions, boundMs, thinkMin, thinkMax, maxCalls) {
    let stopping = false;
    let wake;
    const stopped = new Promise(resolve => {
        wake = resolve;
    });
    const stop = () => {
        stopping = true;
        wake();
    };
    let go;
    const started = new Promise(resolve => {
        go = resolve;
    });
    let input = '';
    process.stdin.setEncoding('utf8');
    process.stdin.on('data', chunk => {
        input += chunk;
        if (input.split('\n').some(l => l.trim() === 'go')) go();
    });
    process.stdin.on('end', stop);
    process.stdin.on('close', stop);
    process.on('SIGTERM', stop);
    process.on('SIGINT', stop);

    const clients = [];
    const opened = [];
    for (let i = 0; i < sessions; i++) {
        const client = new Client({ name: 'failover-bench-ts-sdk', version: '0.0.0' });
        const transport = new StreamableHTTPClientTransport(new URL(url));
        clients.push(client);
        opened.push(client.connect(transport).then(() => transport));
    }
    const transports = await Promise.all(opened);
    await Promise.all(clients.map(client => bounded(client, 'get_counter', boundMs)));
    line({ type: 'ready', sessions: transports.map((t, session) => ({ session, session_id: t.sessionId ?? null })) });

    await Promise.race([started, stopped]);
    const drive = async (client, session) => {
        for (let calls = 0; !stopping && calls < maxCalls; calls++) {
            const start = now();
            const record = { type: 'call', session, start, duration: 0, ok: false, counter: null };
            Object.assign(record, { instance: null, error: null, overran: false });
            try {
                const answer = await bounded(client, 'increment_counter', boundMs);
                record.ok = true;
                record.counter = Number(answer.counter);
                record.instance = answer.instance ?? null;
            } catch (error) {
                record.error = errorText(error);
                record.overran = error?.overran === true;
            }
            record.duration = now() - start;
            line(record);
            if (stopping) break;
            await Promise.race([sleep(1000 * (thinkMin + Math.random() * (thinkMax - thinkMin))), stopped]);
        }
    };
    await Promise.all(clients.map(drive));
    line({ type: 'stopped' });

    await Promise.all(
        clients.map(async (client, session) => {
            let error = null;
            for (let attempt = 0; attempt < FINAL_READ_ATTEMPTS; attempt++) {
                if (attempt) await sleep(FINAL_READ_PAUSE_MS);
                try {
                    const answer = await bounded(client, 'get_counter', boundMs);
                    line({ type: 'final', session, counter: Number(answer.counter), error: null });
                    return;
                } catch (e) {
                    error = errorText(e);
                }
            }
            line({ type: 'final', session, counter: null, error });
        })
    );
    line({ type: 'done' });
    // Ending the sessions (DELETE) is housekeeping: bounded, and its failures are not reported.
    await Promise.race([Promise.allSettled(clients.map(client => client.close())), sleep(CLOSE_BOUND_MS)]);
}

const args = process.argv.slice(2);
const [url, sessions, bound, thinkMin, thinkMax, maxCalls] = [args[0], ...args.slice(1).map(Number)];
if (
    args.length !== 6 ||
    !Number.isInteger(sessions) ||
    sessions < 1 ||
    !(bound > 0) ||
    !(thinkMin >= 0 && thinkMax >= thinkMin) ||
    !Number.isInteger(maxCalls)
) {
    fail('usage: node failover_client.mjs <mcp-url> <sessions> <bound-s> <think-min-s> <think-max-s> <max-calls>', 2);
}
try {
    await main(url, sessions, bound * 1000, thinkMin, thinkMax, maxCalls);
    process.exit(0);
} catch (error) {
    fail(error?.stack ?? String(error));
}
