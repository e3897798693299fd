// A second, independent client for the HA stack: the official MCP TypeScript SDK
// (v2, @modelcontextprotocol/client) speaking protocol 2026-07-28, sessionless.
// pytest runs it as a subprocess, so its interface is argv in, JSON out:
//
//   node client.mjs elicit <mcp-url>[,<mcp-url>...] N -> one JSON object
//     (several URLs: requests go to each in turn, so a round trip's legs reach different replicas)
//   node client.mjs listen <mcp-url> URI SECONDS -> JSON lines
//
// Exit 0 on success; nonzero with a message on stderr otherwise (3: listen stream lost).
import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';

const PROTOCOL_VERSION = '2026-07-28';

function fail(message, code = 1) {
    process.stderr.write(`client.mjs: ${message}\n`);
    process.exit(code);
}

// Sends each request to the next of `urls`, and notes where each reset_counter leg went.
function rotating(urls, legs) {
    let next = 0;
    return (input, init) => {
        const url = new URL(input instanceof Request ? input.url : String(input));
        url.host = new URL(urls[next++ % urls.length]).host;
        const body = typeof init?.body === 'string' ? JSON.parse(init.body) : {};
        if (body.method === 'tools/call' && body.params?.name === 'reset_counter') legs.push(url.host);
        return fetch(url, init);
    };
}

async function connect(url, fetch = undefined) {
    const client = new Client(
        { name: 'mcp-ha-ts-client', version: '0.0.0' },
        {
            // Without this the SDK stays on the 2025 `initialize` handshake (its default is
            // 'legacy'); pinning makes connect() a `server/discover` that must offer exactly
            // this revision, and every request then carries the 2026 `_meta` envelope.
            versionNegotiation: { mode: { pin: PROTOCOL_VERSION } },
            // Form elicitation is what reset_counter asks for; declaring it lets the SDK's
            // input_required driver dispatch the embedded request to our handler.
            capabilities: { elicitation: { form: {} } }
        }
    );
    await client.connect(new StreamableHTTPClientTransport(new URL(url), fetch ? { fetch } : {}));
    return client;
}

// The tool's result as a JSON object: structuredContent when the server sent it,
// else the first text block parsed (FastMCP sends both for dict results).
function structured(result, tool) {
    if (result.isError) {
        throw new Error(`${tool} failed: ${JSON.stringify(result.content)}`);
    }
    if (result.structuredContent && typeof result.structuredContent === 'object') {
        return result.structuredContent;
    }
    const text = result.content?.find(block => block.type === 'text')?.text;
    if (text === undefined) throw new Error(`${tool} returned no structured result`);
    return JSON.parse(text);
}

async function elicit(urls, n) {
    const legs = [];
    const client = await connect(urls[0], urls.length > 1 ? rotating(urls, legs) : undefined);
    // On 2026-07-28 the server asks for input by answering tools/call with an
    // input_required result. The SDK routes each embedded elicitation/create to this
    // handler, then resends the call itself with inputResponses and the sealed
    // requestState echoed verbatim (the resend may land on any replica).
    client.setRequestHandler('elicitation/create', async () => ({
        action: 'accept',
        content: { value: true }
    }));
    const call = async (name, args = {}) => structured(await client.callTool({ name, arguments: args }), name);

    const { session_id } = await call('create_session');
    await call('increment_counter', { session_id });
    const results = [];
    for (let i = 0; i < n; i++) {
        await call('increment_counter', { session_id }); // so each reset has something to reset
        results.push(await call('reset_counter', { session_id }));
    }
    await client.close();
    const ok = results.filter(r => r.reset === true).length;
    // Two legs per reset: [first, second] hosts, when the requests were rotated.
    const pairs = results.map((_, i) => legs.slice(2 * i, 2 * i + 2));
    process.stdout.write(JSON.stringify({ ok, results, legs: pairs }) + '\n');
}

function line(obj) {
    // One JSON object per line, written straight to fd 1 so a reader sees it at once.
    process.stdout.write(JSON.stringify(obj) + '\n');
}

async function listen(url, uri, seconds) {
    const client = await connect(url);
    // Events on a listen stream dispatch to the ordinary notification handlers.
    client.setNotificationHandler('notifications/resources/updated', n =>
        line({ event: 'resources/updated', uri: n.params.uri, t: Date.now() })
    );
    client.setNotificationHandler('notifications/tools/list_changed', () =>
        line({ event: 'tools/list_changed', t: Date.now() })
    );
    // listen() resolves when notifications/subscriptions/acknowledged (carrying our listen id
    // in _meta) arrives; bound that wait by SECONDS rather than the SDK's 60 s default.
    const subscription = await client.listen(
        { resourceSubscriptions: [uri], toolsListChanged: true },
        { timeout: seconds * 1000 }
    );
    line({ acked: true });

    const timer = new Promise(resolve => setTimeout(() => resolve('timeout'), seconds * 1000));
    const outcome = await Promise.race([timer, subscription.closed]);
    if (outcome === 'timeout') {
        await subscription.close();
        await client.close();
        return;
    }
    // 'remote': the stream ended with no response (a replica died, a proxy cut it).
    // 'graceful': the server ended it on purpose before SECONDS were up; report it too,
    // since a caller waiting for events has lost them either way.
    line({ lost: true, t: Date.now(), how: outcome });
    process.exit(3);
}

const [command, url, ...rest] = process.argv.slice(2);
try {
    if (command === 'elicit' && url && rest.length === 1 && Number.isInteger(Number(rest[0])) && Number(rest[0]) >= 0) {
        await elicit(url.split(','), Number(rest[0]));
    } else if (command === 'listen' && url && rest.length === 2 && Number(rest[1]) > 0) {
        await listen(url, rest[0], Number(rest[1]));
    } else {
        fail('usage: node client.mjs elicit <mcp-url> N | listen <mcp-url> URI SECONDS', 2);
    }
    process.exit(0);
} catch (error) {
    fail(error?.stack ?? String(error));
}
