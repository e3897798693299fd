// The official MCP TypeScript SDK v2 (@modelcontextprotocol/client, pinned to 2026-07-28, its default
// request timeout) making one long streamed call whose replica the test kills, for
// tests/clients/test_streaming_failover.py. The call goes through `callToolRetrying` as
// docs/generations.md shows it ("When a call's replica dies"): the snippet is read from the page and
// run as it is, so the page shows what is tested.
//
//   node cut_call_client.mjs <mcp-url> <num-items> <docs-page>
//
// stdout, one JSON object per line, each as it happens:
//   {"type":"handle","session_id":"...","timeout_ms":60000}
//   {"type":"serving","replica":"mcp-server-2"}        the replica that answered an analyze_data POST
//   {"type":"progress","progress":3}
//   {"type":"reconnect","status":200,"replica":"mcp-server-1"}   the transport's GET with Last-Event-ID
//   {"type":"attempt","attempt":1,"ok":false,"key":"...","name":"ProtocolError","code":-32603,"data":{...},"error":"..."}
//   {"type":"result","structured":{...},"error":null}
// Exit status: 0 when it got that far, 1 with a message on stderr otherwise (2: usage).
import { readFileSync } from 'node:fs';
import { Client, DEFAULT_REQUEST_TIMEOUT_MSEC, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import { errorText, failer, line, structured } from './common.mjs';

const fail = failer('cut_call_client.mjs');
const SECTION = "## When a call's replica dies (2026-07-28)";
const KEY = 'io.github.mcp-ha-kit/idempotency-key';

// The page's `callToolRetrying`, imported from its js block with the SDK's specifier resolved here
// (a data: module resolves no bare specifier), so it uses this script's very ProtocolError.
async function documented(page) {
    const section = readFileSync(page, 'utf8').split(SECTION)[1]?.split('\n## ')[0];
    const code = section?.match(/```js\n([\s\S]*?)```/)?.[1];
    if (!code) fail(`no js block under "${SECTION}" in ${page}`);
    const sdk = import.meta.resolve('@modelcontextprotocol/client');
    const source = `${code.replaceAll("'@modelcontextprotocol/client'", `'${sdk}'`)}\nexport { callToolRetrying };\n`;
    return (await import(`data:text/javascript,${encodeURIComponent(source)}`)).callToolRetrying;
}

// fetch, noting which replica answered each analyze_data POST and each reconnection.
async function noting(input, init) {
    const response = await fetch(input, init);
    const replica = response.headers.get('mcp-ha-replica');
    const body = typeof init?.body === 'string' ? JSON.parse(init.body) : undefined;
    if (body?.method === 'tools/call' && body.params?.name === 'analyze_data') line({ type: 'serving', replica });
    if ((init?.method ?? 'GET') === 'GET') line({ type: 'reconnect', status: response.status, replica });
    return response;
}

async function main(url, items, page) {
    const callToolRetrying = await documented(page);
    const client = new Client(
        { name: 'cut-call-ts-sdk', version: '0.0.0' },
        { versionNegotiation: { mode: { pin: '2026-07-28' } } }
    );
    await client.connect(new StreamableHTTPClientTransport(new URL(url), { fetch: noting }));
    const { session_id } = structured(await client.callTool({ name: 'create_session', arguments: {} }), 'create_session');
    line({ type: 'handle', session_id, timeout_ms: DEFAULT_REQUEST_TIMEOUT_MSEC });

    // What the snippet calls: the client itself, each attempt noted as it ends.
    let attempts = 0;
    const noted = {
        callTool: async (params, options) => {
            const attempt = { type: 'attempt', attempt: ++attempts, key: params._meta?.[KEY] ?? null };
            try {
                const result = await client.callTool(params, options);
                line({ ...attempt, ok: true });
                return result;
            } catch (error) {
                const { code = null, data = null } = error ?? {};
                line({ ...attempt, ok: false, name: error?.constructor?.name, code, data, error: errorText(error, 500) });
                throw error;
            }
        }
    };
    const outcome = { type: 'result', structured: null, error: null };
    try {
        const params = { name: 'analyze_data', arguments: { num_items: items, session_id } };
        const result = await callToolRetrying(noted, params, { onprogress: ({ progress }) => line({ type: 'progress', progress }) });
        outcome.structured = structured(result, 'analyze_data');
    } catch (error) {
        outcome.error = errorText(error, 500);
    }
    line(outcome);
    await Promise.race([client.close().catch(() => {}), new Promise(resolve => setTimeout(resolve, 5000))]);
}

const [url, items, page] = process.argv.slice(2);
if (!url || !Number.isInteger(Number(items)) || !page) fail('usage: cut_call_client.mjs <mcp-url> <num-items> <docs-page>', 2);
main(url, Number(items), page).then(
    () => process.exit(0),
    error => fail(errorText(error, 2000))
);
