// prepack: copy the relay's Lua scripts (relay/broker/rediscluster/lua/, their one
// source) into this package's lua/, so that the published package runs the same files.
// The repository's tests check the copy against the source (tests/unit/test_producer_ts.py).
import { copyFileSync, existsSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const pkg = join(dirname(fileURLToPath(import.meta.url)), '..');
const src = join(pkg, '..', '..', 'relay', 'broker', 'rediscluster', 'lua');
if (!existsSync(join(src, 'publish.lua'))) {
  console.error(`copy-lua: no Lua scripts at ${src} (pack from the tokenrelay repository)`);
  process.exit(1);
}
const out = join(pkg, 'lua');
rmSync(out, { recursive: true, force: true });
mkdirSync(out);
for (const f of readdirSync(src).filter((f) => f.endsWith('.lua')).sort()) copyFileSync(join(src, f), join(out, f));
