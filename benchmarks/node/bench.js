#!/usr/bin/env node
// Node side of benchmarks/peers.py: redis-semaphore's Semaphore and MultiSemaphore on ioredis,
// driven through the same line protocol as the Python workers (benchmarks/_peer_workers.py):
//
//   node bench.js MODE ARGS_JSON
//   -> {"ready": pid}            then, per mode, commands on stdin, one JSON answer per line.
//
// Times are process.hrtime.bigint() in seconds: libuv reads CLOCK_MONOTONIC on Linux, the clock
// Python's time.monotonic() reads, so the harness can subtract a time taken here from one taken
// in another process. Nothing but protocol lines goes to stdout.
//
// Modes:
//   chain      N participants in a FIFO-less chain (capacity 1): acquire, note, release, queue
//              again. "stall": the next participant to acquire holds forever (the others wait).
//              "dump": the records, then exit.
//   fair       participants with mixed sizes (MultiSemaphore permits) on a weighted semaphore,
//              each holding hold_ms; "dump": records and the waits still in progress.
//   rates      interleaved single-connection rates: EVALSHA of 'return 1' (the ioredis ceiling)
//              and acquire+release pairs of each kind, in alternating slices.
//   holder     acquire once (lockTimeout from the args), say so, then idle until SIGKILLed.
//   waiter     on "q": acquire (after a holder), report the grant time, release, say so.
'use strict';

const Redis = require('ioredis');
const { Semaphore, MultiSemaphore } = require('redis-semaphore');
const readline = require('readline');
const fs = require('fs');

const mono = () => Number(process.hrtime.bigint()) / 1e9;
const emit = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const [mode, argsJson] = process.argv.slice(2);
const a = JSON.parse(argsJson || '{}');

function client() {
  const u = new URL(a.url);
  return new Redis({ host: u.hostname, port: Number(u.port), db: Number((u.pathname || '/0').slice(1) || 0),
                     lazyConnect: false, enableAutoPipelining: false, maxRetriesPerRequest: 3 });
}

// One lock object per acquisition (the library's usual use: a fresh identifier each time).
function makeLock(c, kind, key, limit, permits, opts) {
  return kind === 'multi' ? new MultiSemaphore(c, key, limit, permits, opts) : new Semaphore(c, key, limit, opts);
}

const lines = [];
let waitingLine = null;
const rl = readline.createInterface({ input: process.stdin });
rl.on('line', (l) => { if (waitingLine) { const w = waitingLine; waitingLine = null; w(l); } else lines.push(l); });
rl.on('close', () => { if (waitingLine) { const w = waitingLine; waitingLine = null; w(''); } else lines.push(''); });
function nextLine() {
  if (lines.length) return Promise.resolve(lines.shift());
  return new Promise((r) => { waitingLine = r; });
}

// Who took the lock last (see Turn in _peer_workers.py): a 4-byte little-endian int in a file
// under /dev/shm shared by every participant of the chain, Python or Node.
function turn(path) {
  const fd = fs.openSync(path, 'r+');
  const buf = Buffer.alloc(4);
  return {
    took(pi) { buf.writeInt32LE(pi, 0); fs.writeSync(fd, buf, 0, 4, 0); },
    last() { fs.readSync(fd, buf, 0, 4, 0); return buf.readInt32LE(0); },
  };
}

async function chain() {
  const c = client();
  await c.ping();
  const opts = a.opts || {};
  const tn = turn(a.turn);
  const recs = [];
  const errors = [];
  let stall = false;
  let stop = false;
  async function participant(pi) {
    try {
      while (!stop) {
        const lock = makeLock(c, a.kind, a.key, 1, 1, opts);
        const t_call = mono();
        await lock.acquire();
        const tg = mono();
        tn.took(pi);
        if (stall) {
          recs.push([pi, t_call, tg, null, null, -1]);
          return; // holds forever: its refresh timer keeps the entry alive
        }
        await sleep(a.hold_ms);
        const t0 = mono();
        await lock.release();
        const tr = mono();
        recs.push([pi, t_call, tg, t0, tr, -1]);
        while (tn.last() === pi) await sleep(0.2); // timers round up to 1 ms
      }
    } catch (e) {
      errors.push(String(e && e.stack || e).slice(0, 500));
    }
  }
  emit({ ready: process.pid });
  if ((await nextLine()).trim() !== 'go') process.exit(0);
  for (let i = 0; i < a.n; i++) participant(a.base + i);
  for (;;) {
    const l = (await nextLine()).trim();
    if (l === 'stall') { stall = true; emit({ stalled: true }); continue; }
    break; // "dump" or EOF
  }
  stop = true;
  emit({ recs, errors: errors.slice(0, 5) });
  process.exit(0);
}

async function fair() {
  const c = client();
  await c.ping();
  const opts = a.opts || {};
  const recs = [];
  const pending = {};
  const errors = [];
  let stop = false;
  async function participant(pi, size) {
    try {
      while (!stop) {
        const lock = makeLock(c, 'multi', a.key, a.limit, size, opts);
        const t_call = mono();
        pending[pi] = [t_call, size];
        await lock.acquire();
        const tg = mono();
        delete pending[pi];
        await sleep(a.hold_ms);
        const t0 = mono();
        await lock.release();
        recs.push([pi, size, t_call, tg, t0]);
      }
    } catch (e) {
      errors.push(String(e && e.stack || e).slice(0, 500));
    }
  }
  emit({ ready: process.pid });
  if ((await nextLine()).trim() !== 'go') process.exit(0);
  a.sizes.forEach((s, i) => participant(a.base + i, s));
  await nextLine();
  const t_end = mono();
  stop = true;
  emit({ recs, pending, t_end, errors: errors.slice(0, 5) });
  process.exit(0);
}

async function rate(fn, seconds) {
  let n = 0;
  const t0 = mono();
  const end = t0 + seconds;
  for (;;) {
    for (let i = 0; i < 20; i++) await fn();
    n += 20;
    const now = mono();
    if (now >= end) return n / (now - t0);
  }
}

async function rates() {
  const c = client();
  await c.ping();
  const sha = await c.script('LOAD', 'return 1');
  const opts = a.opts || {};
  const fns = {
    C: () => c.evalsha(sha, 0),
    sem: async () => { const l = new Semaphore(c, a.key + ':sem', 1000000, opts); await l.acquire(); await l.release(); },
    multi: async () => { const l = new MultiSemaphore(c, a.key + ':multi', 1000000, 1, opts); await l.acquire(); await l.release(); },
  };
  emit({ ready: process.pid });
  if ((await nextLine()).trim() !== 'go') process.exit(0);
  for (const f of Object.values(fns)) await rate(f, 0.1); // warm up: connection, scripts, JIT
  const plan = ['C'];
  for (let r = 0; r < a.rounds; r++) for (const s of ['sem', 'multi']) plan.push(s, 'C');
  const out = [];
  for (const p of plan) out.push(await rate(fns[p], a.slice_s));
  emit({ plan, rates: out });
  process.exit(0);
}

async function holder() {
  const c = client();
  await c.ping();
  emit({ ready: process.pid });
  if ((await nextLine()).trim() !== 'go') process.exit(0);
  const lock = makeLock(c, a.kind, a.key, a.limit, a.permits, a.opts || {});
  await lock.acquire();
  emit({ acquired: mono(), identifier: lock.identifier, wall_ms: Date.now() });
  setInterval(() => {}, 1 << 30); // keep running (refreshing) until SIGKILL
}

async function waiter() {
  const c = client();
  await c.ping();
  emit({ ready: process.pid });
  for (;;) {
    const l = (await nextLine()).trim();
    if (l !== 'q') process.exit(0);
    const lock = makeLock(c, a.kind, a.key, a.limit, a.permits, a.opts || {});
    emit({ queued: mono() });
    try {
      await lock.acquire();
    } catch (e) {
      emit({ error: String(e).slice(0, 300) });
      continue;
    }
    emit({ granted: mono(), wall_ms: Date.now() });
    await lock.release();
    emit({ released: true });
  }
}

const modes = { chain, fair, rates, holder, waiter };
if (!modes[mode]) {
  process.stderr.write(`unknown mode ${mode}\n`);
  process.exit(2);
}
modes[mode]().catch((e) => { process.stderr.write(String(e && e.stack || e) + '\n'); process.exit(1); });
