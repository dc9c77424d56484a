package index

import (
	"fmt"
	"testing"

	"github.com/kvrelay/kvrelay/gateway/index/tracegen"
)

func TestZZScratchBreakdown(t *testing.T) {
	bs := 128
	reqs, _ := tracegen.Synthetic(tracegen.SyntheticConfig{Seed: 42, Sessions: 8000, Turns: 5, PrefixPool: 32, PrefixBlocks: 2048 / bs, TurnBlocks: 512 / bs, BlockSize: bs})
	plan := planReplay(reqs, 128, bs, 65536/bs)
	ix, _, _ := replay(plan, bs, hashedInput)
	st := ix.Stats()
	m := float64(st.Memberships)
	var tab, dir, live, spare, arr, sets, sfree, rfree int
	for i := range ix.shards {
		sh := &ix.shards[i]
		tab += len(sh.tab.Load().w) * 8
		dir += len(sh.dir.Load().r) * 8
		live += sh.runsUsed - len(sh.runsFree)
		spare += sh.spareBytes
		arr += sh.bytes
		sets += len(sh.sets.Load().w) * 8
		sfree += cap(sh.setsFree) * 4
		rfree += cap(sh.runsFree) * 4
	}
	var refs, revs, revslots, revn int
	for _, ws := range ix.workers {
		refs += len(ws.refs)
		for _, rt := range ws.ranks {
			revs++
			revslots += len(rt.slots)
			revn += rt.n
		}
	}
	var su, sf, sw int
	for i := range ix.shards {
		sh := &ix.shards[i]
		su += sh.setsUsed
		sf += len(sh.setsFree)
		sw += len(sh.sets.Load().w)
	}
	fmt.Printf("setsUsed %d free %d words %d\n", su, sf, sw)
	fmt.Printf("memb %d entries %d runs %d tab %.2f dir %.2f arrays %.2f spare %.2f sets %.2f sfree %.2f rfree %.2f refs %d (%.2f) revtables %d slots %d n %d\n",
		st.Memberships, st.Entries, live, float64(tab)/m, float64(dir)/m, float64(arr)/m, float64(spare)/m, float64(sets)/m, float64(sfree)/m, float64(rfree)/m, refs, float64(refs*16)/m, revs, revslots, revn)
}
