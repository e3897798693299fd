// What the Node clients run by the tests share: one JSON object per stdout line, a failure on
// stderr with an exit status, and a tool's answer read as the SDK gives it.

export function line(obj) {
    process.stdout.write(JSON.stringify(obj) + '\n');
}

export function failer(script) {
    return (message, code = 1) => {
        process.stderr.write(`${script}: ${message}\n`);
        process.exit(code);
    };
}

export const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

export const errorText = (error, max = 200) =>
    `${error?.name ?? 'Error'}: ${error?.message ?? String(error)}`.slice(0, max);

// The tool's answer as an object; a tool error (isError) raises.
export function structured(result, tool) {
    if (result.isError) {
        const text = result.content?.find(block => block.type === 'text')?.text ?? JSON.stringify(result.content);
        throw new Error(`${tool} answered isError: ${text}`);
    }
    if (result.structuredContent && typeof result.structuredContent === 'object') return result.structuredContent;
    const text = result.content?.find(block => block.type === 'text')?.text;
    if (text === undefined) throw new Error(`${tool} returned no structured result`);
    return JSON.parse(text);
}
