package picker

// Fleet keeps the eligible workers' in-flight counts between requests, so a
// pick reads the fleet's mean and its least-loaded worker without walking
// every worker: the sum is kept as counts change, and the workers sit in a
// binary min-heap ordered by (in-flight, name), whose root is the
// least-loaded worker with ties to the first name, the choice leastLoaded
// makes over a sorted list. An update costs O(log n); PickFleet then costs
// O(candidates + log n) instead of O(fleet).
//
// A Fleet is not safe for concurrent use: its owner guards it with the lock
// that already orders its load updates (the gateway's).
type Fleet struct {
	heap  []fleetSlot
	pos   map[string]int // worker → its index in heap
	total int            // sum of the in-flight counts
}

type fleetSlot struct {
	worker string
	load   int
}

// NewFleet returns an empty Fleet.
func NewFleet() *Fleet {
	return &Fleet{pos: map[string]int{}}
}

// Add makes w eligible with no request in flight; adding a member again
// does nothing. The empty name is not a worker and is ignored.
func (f *Fleet) Add(w string) {
	if _, ok := f.pos[w]; ok || w == "" {
		return
	}
	f.heap = append(f.heap, fleetSlot{worker: w})
	f.pos[w] = len(f.heap) - 1
	f.up(len(f.heap) - 1)
}

// Remove drops w; removing a non-member does nothing.
func (f *Fleet) Remove(w string) {
	i, ok := f.pos[w]
	if !ok {
		return
	}
	f.total -= f.heap[i].load
	last := len(f.heap) - 1
	f.swap(i, last)
	f.heap = f.heap[:last]
	delete(f.pos, w)
	if i < last {
		f.fix(i)
	}
}

// Set records w's in-flight count (a negative count is 0, as Pick reads
// one). It reports false, changing nothing, when w is not a member.
func (f *Fleet) Set(w string, inflight int) bool {
	i, ok := f.pos[w]
	if !ok {
		return false
	}
	inflight = max(inflight, 0)
	f.total += inflight - f.heap[i].load
	f.heap[i].load = inflight
	f.fix(i)
	return true
}

// Load is w's in-flight count; 0 for a non-member.
func (f *Fleet) Load(w string) int {
	if i, ok := f.pos[w]; ok {
		return f.heap[i].load
	}
	return 0
}

func (f *Fleet) lookup(w string) (int, bool) {
	if i, ok := f.pos[w]; ok {
		return f.heap[i].load, true
	}
	return 0, false
}

// Has reports whether w is a member.
func (f *Fleet) Has(w string) bool {
	_, ok := f.pos[w]
	return ok
}

// Len is the number of members.
func (f *Fleet) Len() int { return len(f.heap) }

// Mean is the members' mean in-flight count; 0 for an empty fleet.
func (f *Fleet) Mean() float64 {
	if len(f.heap) == 0 {
		return 0
	}
	return float64(f.total) / float64(len(f.heap))
}

// LeastLoaded is the member with the fewest requests in flight, ties to the
// first name; "" for an empty fleet.
func (f *Fleet) LeastLoaded() string {
	if len(f.heap) == 0 {
		return ""
	}
	return f.heap[0].worker
}

func (f *Fleet) less(i, j int) bool {
	a, b := f.heap[i], f.heap[j]
	if a.load != b.load {
		return a.load < b.load
	}
	return a.worker < b.worker
}

func (f *Fleet) swap(i, j int) {
	f.heap[i], f.heap[j] = f.heap[j], f.heap[i]
	f.pos[f.heap[i].worker] = i
	f.pos[f.heap[j].worker] = j
}

// fix restores the heap order after slot i changed.
func (f *Fleet) fix(i int) {
	if !f.down(i) {
		f.up(i)
	}
}

func (f *Fleet) up(i int) {
	for i > 0 {
		parent := (i - 1) / 2
		if !f.less(i, parent) {
			return
		}
		f.swap(i, parent)
		i = parent
	}
}

// down sifts slot i towards the leaves and reports whether it moved.
func (f *Fleet) down(i int) bool {
	start := i
	for {
		smallest, l, r := i, 2*i+1, 2*i+2
		if l < len(f.heap) && f.less(l, smallest) {
			smallest = l
		}
		if r < len(f.heap) && f.less(r, smallest) {
			smallest = r
		}
		if smallest == i {
			return i != start
		}
		f.swap(i, smallest)
		i = smallest
	}
}
