// Package prefixcache is the simulator's per-DP-rank KV prefix cache: a chain
// of content-hashed blocks with LRU eviction of leaves, shared prefixes,
// optional second physical copies of one hash (as vLLM keeps sometimes) and an
// optional host tier that evicted device blocks are offloaded to. Every
// operation returns the KV events it produced, and the cache reports its true
// live set, which exactness tests compare a relay's or a gateway's view to.
package prefixcache

import (
	"container/list"
	"errors"
	"fmt"
	"sort"
)

// Tier is where a block lives.
type Tier int

const (
	// Device is GPU memory: the engine's main KV cache.
	Device Tier = iota
	// Host is the CPU tier that evicted device blocks are offloaded to.
	Host
)

func (t Tier) String() string {
	if t == Host {
		return "host"
	}
	return "device"
}

// Event is one KV event, engine-neutral; sim's encoders turn it into each
// engine's msgpack.
type Event interface{ isEvent() }

// BlockStored reports blocks that became live, in chain order: Hashes[i] is
// the parent of Hashes[i+1] and Parent is the block before Hashes[0].
type BlockStored struct {
	Hashes    []uint64
	Parent    uint64
	HasParent bool
	Tokens    []uint32
	BlockSize int
	Tier      Tier
}

// BlockRemoved reports that one physical copy of each hash was freed.
type BlockRemoved struct {
	Hashes []uint64
	Tier   Tier
}

// AllBlocksCleared reports that every block on every tier was dropped.
type AllBlocksCleared struct{}

func (BlockStored) isEvent()      {}
func (BlockRemoved) isEvent()     {}
func (AllBlocksCleared) isEvent() {}

// Config sizes a cache and picks the engine behaviours it imitates.
type Config struct {
	// BlockSize is tokens per block (page size); partial tail blocks are
	// never cached, as in the engines.
	BlockSize int
	// CapacityBlocks is the device tier's size in physical blocks.
	CapacityBlocks int
	// HostCapacityBlocks sizes the host tier; 0 disables it.
	HostCapacityBlocks int
	// Hasher computes the engine's block hashes.
	Hasher Hasher
	// OneBlockPerEvent makes every BlockStored carry a single block, as
	// SGLang's radix cache and TokenSpeed publish; vLLM stores a request's
	// new blocks in one event.
	OneBlockPerEvent bool
	// SecondCopies imitates vLLM's duplicate physical blocks: when two
	// requests of one step both miss the same block, each allocates (and
	// reports) its own copy. Without it the second request shares the first's
	// block, as a radix tree does.
	SecondCopies bool
}

// LiveKey identifies a live block: its tier and published hash.
type LiveKey struct {
	Tier Tier
	Hash uint64
}

// Result is what one request found in the cache.
type Result struct {
	// TotalBlocks is the number of full blocks in the request's prompt.
	TotalBlocks int `json:"total_blocks"`
	// DeviceHits is the length of the cached device prefix, in blocks.
	DeviceHits int `json:"device_hits"`
	// HostHits counts the blocks after that prefix reloaded from the host tier.
	HostHits int `json:"host_hits"`
	// StoredBlocks counts the physical device blocks this request allocated.
	StoredBlocks int `json:"stored_blocks"`
}

type node struct {
	digest    Digest
	hash      uint64
	parent    *node
	children  int
	copies    int
	tokens    []uint32
	lru       *list.Element
	bornStep  uint64
	bornReq   uint64
	pinnedReq uint64
}

type hostEntry struct {
	digest    Digest
	hash      uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
	lru       *list.Element
}

// Cache is one DP rank's prefix cache. It is not safe for concurrent use.
type Cache struct {
	cfg Config

	nodes map[Digest]*node
	// lru orders device nodes most recent first. A request touches its path
	// leaf first, so parents are always more recent than their children and
	// a scan from the back meets leaves early.
	lru  *list.List
	used int

	host    map[Digest]*hostEntry
	hostLRU *list.List

	step uint64
	req  uint64
}

// New checks cfg and returns an empty cache.
func New(cfg Config) (*Cache, error) {
	switch {
	case cfg.BlockSize <= 0:
		return nil, fmt.Errorf("prefixcache: block size %d: must be positive", cfg.BlockSize)
	case cfg.CapacityBlocks <= 0:
		return nil, fmt.Errorf("prefixcache: capacity %d blocks: must be positive", cfg.CapacityBlocks)
	case cfg.HostCapacityBlocks < 0:
		return nil, fmt.Errorf("prefixcache: host capacity %d blocks: must not be negative", cfg.HostCapacityBlocks)
	case cfg.Hasher == nil:
		return nil, errors.New("prefixcache: no hasher")
	}
	c := &Cache{cfg: cfg}
	c.Reset()
	return c, nil
}

// Reset drops every block without reporting anything: what an engine restart
// does to its cache.
func (c *Cache) Reset() {
	c.nodes = make(map[Digest]*node)
	c.lru = list.New()
	c.used = 0
	c.host = make(map[Digest]*hostEntry)
	c.hostLRU = list.New()
}

// Clear drops every block on every tier and reports AllBlocksCleared, as a
// prefix-cache reset does in vLLM and SGLang.
func (c *Cache) Clear() []Event {
	c.Reset()
	return []Event{AllBlocksCleared{}}
}

// EvictAll frees every block through the ordinary eviction path (leaves
// first, one removal per copy), for engines that never report
// AllBlocksCleared (TokenSpeed).
func (c *Cache) EvictAll() []Event {
	c.req++ // nothing is pinned by the current request id
	var evs []Event
	for c.used > 0 {
		if !c.evictOne(&evs, false) {
			break
		}
	}
	for c.hostLRU.Len() > 0 {
		c.evictHost(&evs)
	}
	return evs
}

// BeginStep starts a scheduler step: requests inserted in the same step are
// "concurrent" for SecondCopies.
func (c *Cache) BeginStep() { c.step++ }

// Used is the number of physical blocks held on tier.
func (c *Cache) Used(t Tier) int {
	if t == Host {
		return len(c.host)
	}
	return c.used
}

// Insert runs one request's prompt through the cache: it matches the cached
// prefix, reloads what the host tier holds, allocates the rest (evicting
// least-recently-used leaves, offloading them to the host tier when there is
// one) and returns the events in the order the engine would report them.
// Blocks that do not fit even after evicting everything evictable are not
// cached.
func (c *Cache) Insert(tokens []uint32) (Result, []Event) {
	c.req++
	bs := c.cfg.BlockSize
	res := Result{TotalBlocks: len(tokens) / bs}
	var evs []Event

	var path []*node
	var parent *node
	var stored []*node // device blocks allocated by this request, chain order
	devicePrefix := true
	for i := 0; i < res.TotalBlocks; i++ {
		blk := tokens[i*bs : (i+1)*bs]
		var pd *Digest
		if parent != nil {
			pd = &parent.digest
		}
		d := c.cfg.Hasher.Chain(pd, blk)
		n := c.nodes[d]
		if n != nil && devicePrefix && c.visible(n) {
			res.DeviceHits++
			n.pinnedReq = c.req
			path = append(path, n)
			parent = n
			continue
		}
		devicePrefix = false
		// From here on every block needs a physical device block.
		if c.used >= c.cfg.CapacityBlocks {
			if !c.evictOne(&evs, true) {
				break
			}
			// The eviction may have freed the very block we were about
			// to add a copy of.
			n = c.nodes[d]
		}
		if he, ok := c.host[d]; ok && n == nil {
			res.HostHits++
			c.hostLRU.MoveToFront(he.lru)
		}
		if n == nil {
			n = &node{digest: d, hash: c.cfg.Hasher.Published(d), parent: parent, tokens: append([]uint32(nil), blk...), bornStep: c.step, bornReq: c.req}
			n.lru = c.lru.PushFront(n)
			c.nodes[d] = n
			if parent != nil {
				parent.children++
			}
		}
		n.copies++
		c.used++
		n.pinnedReq = c.req
		res.StoredBlocks++
		path = append(path, n)
		stored = append(stored, n)
		if c.cfg.OneBlockPerEvent {
			evs = append(evs, c.storedEvent([]*node{n}))
		}
		parent = n
	}
	if !c.cfg.OneBlockPerEvent && len(stored) > 0 {
		evs = append(evs, c.storedEvent(stored))
	}
	// Touch leaf first so parents end up more recent than children.
	for i := len(path) - 1; i >= 0; i-- {
		c.lru.MoveToFront(path[i].lru)
	}
	return res, evs
}

// visible reports whether a request may share n. With SecondCopies, a block
// another request of this same step allocated is not yet shareable: the
// second request computes (and reports) its own copy.
func (c *Cache) visible(n *node) bool {
	return !c.cfg.SecondCopies || n.bornStep != c.step || n.bornReq == c.req
}

func (c *Cache) storedEvent(ns []*node) BlockStored {
	ev := BlockStored{BlockSize: c.cfg.BlockSize, Tier: Device}
	if p := ns[0].parent; p != nil {
		ev.Parent, ev.HasParent = p.hash, true
	}
	for _, n := range ns {
		ev.Hashes = append(ev.Hashes, n.hash)
		ev.Tokens = append(ev.Tokens, n.tokens...)
	}
	return ev
}

// evictOne frees one physical copy of the least-recently-used leaf that the
// current request has not pinned. It reports false when nothing is evictable.
func (c *Cache) evictOne(evs *[]Event, offload bool) bool {
	for e := c.lru.Back(); e != nil; e = e.Prev() {
		n := e.Value.(*node)
		if n.children > 0 || n.pinnedReq == c.req {
			continue
		}
		n.copies--
		c.used--
		*evs = append(*evs, BlockRemoved{Hashes: []uint64{n.hash}, Tier: Device})
		if n.copies > 0 {
			return true
		}
		c.lru.Remove(n.lru)
		delete(c.nodes, n.digest)
		if n.parent != nil {
			n.parent.children--
		}
		if offload && c.cfg.HostCapacityBlocks > 0 {
			c.offload(n, evs)
		}
		return true
	}
	return false
}

func (c *Cache) offload(n *node, evs *[]Event) {
	if he, ok := c.host[n.digest]; ok {
		c.hostLRU.MoveToFront(he.lru)
		return
	}
	if len(c.host) >= c.cfg.HostCapacityBlocks {
		c.evictHost(evs)
	}
	he := &hostEntry{digest: n.digest, hash: n.hash, tokens: n.tokens}
	if n.parent != nil {
		he.parent, he.hasParent = n.parent.hash, true
	}
	he.lru = c.hostLRU.PushFront(he)
	c.host[n.digest] = he
	*evs = append(*evs, BlockStored{Hashes: []uint64{he.hash}, Parent: he.parent, HasParent: he.hasParent,
		Tokens: he.tokens, BlockSize: c.cfg.BlockSize, Tier: Host})
}

func (c *Cache) evictHost(evs *[]Event) {
	e := c.hostLRU.Back()
	if e == nil {
		return
	}
	he := e.Value.(*hostEntry)
	c.hostLRU.Remove(e)
	delete(c.host, he.digest)
	*evs = append(*evs, BlockRemoved{Hashes: []uint64{he.hash}, Tier: Host})
}

// LiveSet is the cache's true state: physical copies per (tier, published
// hash). A consumer that applied every event this cache returned, counting
// copies, holds exactly this.
func (c *Cache) LiveSet() map[LiveKey]int {
	out := make(map[LiveKey]int, len(c.nodes)+len(c.host))
	for _, n := range c.nodes {
		out[LiveKey{Device, n.hash}] += n.copies
	}
	for _, he := range c.host {
		out[LiveKey{Host, he.hash}]++
	}
	return out
}

// LiveBlock is one entry of a sorted live set.
type LiveBlock struct {
	Tier   Tier
	Hash   uint64
	Copies int
}

// SortedLiveSet is LiveSet as a slice ordered by tier, then hash.
func (c *Cache) SortedLiveSet() []LiveBlock {
	ls := c.LiveSet()
	out := make([]LiveBlock, 0, len(ls))
	for k, v := range ls {
		out = append(out, LiveBlock{Tier: k.Tier, Hash: k.Hash, Copies: v})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Tier != out[j].Tier {
			return out[i].Tier < out[j].Tier
		}
		return out[i].Hash < out[j].Hash
	})
	return out
}
