//! Replays the neutral indexer corpus (bench/indexers/README.md, "KVRIDX01")
//! into one Rust indexer on one thread and prints one JSON line: block ops,
//! process CPU seconds of the replay, lookup p50/p99 and a checksum of the
//! lookups' answers (the sum of the best prefix depth), which every indexer
//! replaying the same corpus must reproduce.
//!
//! Usage: kvrelay-indexer-harness <backend> <corpus>
//! Backends: smg-chain, smg-chain-score, dynamo-radix, dynamo-positional.
//!
//! Every event and lookup is turned into the backend's own types before the
//! timed part, so the replay times the index and nothing of the harness but
//! moving an owned event into it.

use std::fs::File;
use std::io::{BufReader, Read};
use std::time::Instant;

use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::{PositionalIndexer, RadixTree};
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock};
use rustc_hash::FxHashMap;

const MAGIC: &[u8; 8] = b"KVRIDX01";
// Bounds on the corpus's declared counts, checked before anything is sized by them.
const MAX_WORKERS: u32 = 1024;
const MAX_BLOCKS_PER_OP: u32 = 1 << 20;
const MAX_OPS: u64 = 1 << 32;

enum Op {
    Lookup { content: Vec<u64> },
    Store { worker: u32, parent: Option<u64>, blocks: Vec<(u64, u64)> }, // (engine, content)
    Remove { worker: u32, hashes: Vec<u64> },
}

struct Corpus {
    block_ops: u64,
    ops: Vec<Op>,
}

struct Reader<R: Read> {
    r: R,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(|e| format!("corpus truncated: {e}"))?;
        Ok(b)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.bytes::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
}

fn read_corpus(path: &str) -> Result<Corpus, String> {
    let f = File::open(path).map_err(|e| format!("open {path}: {e}"))?;
    let mut r = Reader { r: BufReader::with_capacity(1 << 20, f) };
    if &r.bytes::<8>()? != MAGIC {
        return Err(format!("{path}: not a KVRIDX01 corpus"));
    }
    let _block_size = r.u32()?;
    let workers = r.u32()?;
    if workers == 0 || workers > MAX_WORKERS {
        return Err(format!("{path}: {workers} workers, limit {MAX_WORKERS}"));
    }
    let nops = r.u64()?;
    if nops > MAX_OPS {
        return Err(format!("{path}: {nops} operations, limit {MAX_OPS}"));
    }
    let block_ops = r.u64()?;
    let mut ops = Vec::new();
    let mut counted = 0u64;
    for i in 0..nops {
        let kind = r.u8()?;
        let worker = r.u32()?;
        let n = r.u32()?;
        if worker >= workers {
            return Err(format!("op {i}: worker {worker} of {workers}"));
        }
        if n > MAX_BLOCKS_PER_OP {
            return Err(format!("op {i}: {n} blocks, limit {MAX_BLOCKS_PER_OP}"));
        }
        counted += n as u64;
        ops.push(match kind {
            0 => {
                let mut content = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    content.push(r.u64()?);
                    let _prefix = r.u64()?;
                }
                Op::Lookup { content }
            }
            1 => {
                let has_parent = r.u8()? != 0;
                let parent = r.u64()?;
                let mut blocks = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let engine = r.u64()?;
                    let content = r.u64()?;
                    let _prefix = r.u64()?;
                    blocks.push((engine, content));
                }
                Op::Store { worker, parent: has_parent.then_some(parent), blocks }
            }
            2 => {
                let mut hashes = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    hashes.push(r.u64()?);
                }
                Op::Remove { worker, hashes }
            }
            k => return Err(format!("op {i}: unknown kind {k}")),
        });
    }
    if counted != block_ops {
        return Err(format!("{path}: header says {block_ops} block ops, operations hold {counted}"));
    }
    Ok(Corpus { block_ops, ops })
}

fn cpu_seconds() -> f64 {
    // getrusage has no safe wrapper in std; the struct is plain data.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage failed");
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// What a replay measured.
#[derive(Default)]
struct Result_ {
    cpu_s: f64,
    wall_s: f64,
    lat_ns: Vec<u64>,
    checksum: u64,
    apply_errors: u64,
}

/// One backend's prepared operations and how to run them.
trait Backend {
    /// Applies event i (a store or a removal); false if the index refused it.
    fn apply(&mut self, i: usize) -> bool;
    /// Runs lookup i and returns its best prefix depth.
    fn lookup(&mut self, i: usize) -> u32;
}

fn replay(b: &mut dyn Backend, kinds: &[bool]) -> Result_ {
    let mut out = Result_ { lat_ns: Vec::new(), ..Default::default() };
    let c0 = cpu_seconds();
    let t0 = Instant::now();
    for (i, &is_lookup) in kinds.iter().enumerate() {
        if is_lookup {
            let s = Instant::now();
            let best = b.lookup(i);
            out.lat_ns.push(s.elapsed().as_nanos() as u64);
            out.checksum += best as u64;
        } else if !b.apply(i) {
            out.apply_errors += 1;
        }
    }
    out.wall_s = t0.elapsed().as_secs_f64();
    out.cpu_s = cpu_seconds() - c0;
    out
}

struct SmgChain {
    ix: ChainIndex,
    maps: Vec<ChainBlockMap>,
    ids: Vec<u32>,
    ops: Vec<SmgOp>,
    score_into: bool,
}

enum SmgOp {
    Lookup(Vec<ContentHash>),
    Store(usize, Option<SequenceHash>, Vec<StoredBlock>),
    Remove(usize, Vec<SequenceHash>),
}

impl Backend for SmgChain {
    fn apply(&mut self, i: usize) -> bool {
        match &self.ops[i] {
            SmgOp::Store(w, parent, blocks) => {
                self.ix.apply_stored(self.ids[*w], blocks, *parent, &mut self.maps[*w]).is_ok()
            }
            SmgOp::Remove(w, hashes) => {
                self.ix.apply_removed(self.ids[*w], hashes, &mut self.maps[*w]);
                true
            }
            SmgOp::Lookup(_) => unreachable!(),
        }
    }
    fn lookup(&mut self, i: usize) -> u32 {
        let SmgOp::Lookup(q) = &self.ops[i] else { unreachable!() };
        if self.score_into {
            let mut best = 0;
            self.ix.score_into(q, |c| c.0, false, |_, s| best = best.max(s));
            best
        } else {
            let m = self.ix.find_matches(q, false);
            m.scores.values().copied().max().unwrap_or(0)
        }
    }
}

fn smg(c: Corpus, workers: usize, score_into: bool) -> SmgChain {
    let ix = ChainIndex::with_max_workers(workers);
    let ids = (0..workers)
        .map(|w| ix.intern_worker(&format!("worker-{w:03}")).expect("intern worker"))
        .collect();
    let ops = c
        .ops
        .into_iter()
        .map(|op| match op {
            Op::Lookup { content } => SmgOp::Lookup(content.into_iter().map(ContentHash).collect()),
            Op::Store { worker, parent, blocks } => SmgOp::Store(
                worker as usize,
                parent.map(SequenceHash),
                blocks
                    .into_iter()
                    .map(|(e, h)| StoredBlock { seq_hash: SequenceHash(e), content_hash: ContentHash(h) })
                    .collect(),
            ),
            Op::Remove { worker, hashes } => {
                SmgOp::Remove(worker as usize, hashes.into_iter().map(SequenceHash).collect())
            }
        })
        .collect();
    SmgChain { ix, maps: (0..workers).map(|_| ChainBlockMap::new()).collect(), ids, ops, score_into }
}

enum DynOp {
    Lookup(Vec<LocalBlockHash>),
    Event(Option<RouterEvent>),
}

fn dynamo_ops(c: Corpus) -> Vec<DynOp> {
    let mut id = 0u64;
    c.ops
        .into_iter()
        .map(|op| {
            id += 1;
            let ev = |worker: u32, data| {
                DynOp::Event(Some(RouterEvent::new(
                    worker as u64,
                    KvCacheEvent { event_id: id, data, dp_rank: 0 },
                )))
            };
            match op {
                Op::Lookup { content } => DynOp::Lookup(content.into_iter().map(LocalBlockHash).collect()),
                Op::Store { worker, parent, blocks } => ev(
                    worker,
                    KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: parent.map(ExternalSequenceBlockHash),
                        start_position: None,
                        blocks: blocks
                            .into_iter()
                            .map(|(e, h)| KvCacheStoredBlockData {
                                block_hash: ExternalSequenceBlockHash(e),
                                tokens_hash: LocalBlockHash(h),
                                mm_extra_info: None,
                            })
                            .collect(),
                    }),
                ),
                Op::Remove { worker, hashes } => ev(
                    worker,
                    KvCacheEventData::Removed(KvCacheRemoveData {
                        block_hashes: hashes.into_iter().map(ExternalSequenceBlockHash).collect(),
                    }),
                ),
            }
        })
        .collect()
}

struct DynRadix {
    tree: RadixTree,
    ops: Vec<DynOp>,
}

impl Backend for DynRadix {
    fn apply(&mut self, i: usize) -> bool {
        let DynOp::Event(ev) = &mut self.ops[i] else { unreachable!() };
        self.tree.apply_event(ev.take().expect("event replayed twice")).is_ok()
    }
    fn lookup(&mut self, i: usize) -> u32 {
        let DynOp::Lookup(q) = &self.ops[i] else { unreachable!() };
        // RadixTree::find_matches takes the sequence by value: the clone is
        // what a caller holding the request's hashes pays.
        let m = self.tree.find_matches(q.clone(), false);
        m.scores.values().copied().max().unwrap_or(0)
    }
}

struct DynPositional {
    ix: PositionalIndexer,
    blocks: FxHashMap<WorkerWithDpRank, dynamo_kv_router::indexer::positional::LevelIndex>,
    ops: Vec<DynOp>,
}

impl Backend for DynPositional {
    fn apply(&mut self, i: usize) -> bool {
        let DynOp::Event(ev) = &mut self.ops[i] else { unreachable!() };
        self.ix.apply_event(&mut self.blocks, ev.take().expect("event replayed twice"), None).is_ok()
    }
    fn lookup(&mut self, i: usize) -> u32 {
        let DynOp::Lookup(q) = &self.ops[i] else { unreachable!() };
        let m = SyncIndexer::find_matches(&self.ix, q, false);
        m.scores.values().copied().max().unwrap_or(0)
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    // nearest rank
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: {} <smg-chain|smg-chain-score|dynamo-radix|dynamo-positional> <corpus>", args[0]);
        std::process::exit(2);
    }
    let (backend, path) = (args[1].as_str(), args[2].as_str());
    let corpus = match read_corpus(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvrelay-indexer-harness: {e}");
            std::process::exit(1);
        }
    };
    let kinds: Vec<bool> = corpus.ops.iter().map(|o| matches!(o, Op::Lookup { .. })).collect();
    let block_ops = corpus.block_ops;
    let workers = 1 + corpus
        .ops
        .iter()
        .map(|o| match o {
            Op::Store { worker, .. } | Op::Remove { worker, .. } => *worker as usize,
            Op::Lookup { .. } => 0,
        })
        .max()
        .unwrap_or(0);
    let (name, version, mut b): (&str, &str, Box<dyn Backend>) = match backend {
        "smg-chain" => ("smg kv-index ChainIndex find_matches", "kv-index 2.0.0", Box::new(smg(corpus, workers, false))),
        "smg-chain-score" => ("smg kv-index ChainIndex score_into", "kv-index 2.0.0", Box::new(smg(corpus, workers, true))),
        "dynamo-radix" => (
            "dynamo kv-router RadixTree",
            "dynamo-kv-router 1.6.1",
            Box::new(DynRadix { tree: RadixTree::new(), ops: dynamo_ops(corpus) }),
        ),
        "dynamo-positional" => (
            "dynamo kv-router PositionalIndexer (jump 32)",
            "dynamo-kv-router 1.6.1",
            Box::new(DynPositional {
                ix: PositionalIndexer::new(32),
                blocks: FxHashMap::default(),
                ops: dynamo_ops(corpus),
            }),
        ),
        other => {
            eprintln!("kvrelay-indexer-harness: unknown backend {other:?}");
            std::process::exit(2);
        }
    };
    let mut r = replay(b.as_mut(), &kinds);
    r.lat_ns.sort_unstable();
    println!(
        "{{\"indexer\":\"{backend}\",\"name\":\"{name}\",\"version\":\"{version}\",\"block_ops\":{block_ops},\"lookups\":{},\"cpu_s\":{:.6},\"wall_s\":{:.6},\"p50_ns\":{},\"p99_ns\":{},\"checksum\":{},\"apply_errors\":{}}}",
        r.lat_ns.len(),
        r.cpu_s,
        r.wall_s,
        percentile(&r.lat_ns, 50.0),
        percentile(&r.lat_ns, 99.0),
        r.checksum,
        r.apply_errors
    );
}
