package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrelay/kvrelay/testkit/apiclient"
	"github.com/kvrelay/kvrelay/testkit/kvstream"
	"github.com/kvrelay/kvrelay/testkit/logbuf"
	"github.com/kvrelay/kvrelay/testkit/testnats"
)

// The drill of issue #18, in make test-long only (KVRELAY_NATS_DRILL=1):
// three `kvrelay gateway --nats` replicas share placements through a
// three-node JetStream cluster while a steady stream of requests with
// shared prefixes goes through each of them, and the cluster loses one node
// per round, three rounds: first the meta leader, then each time the node
// most replicas are connected to, restarted before the next round.
//
// Each round asserts: no request fails or goes unanswered for longer than
// drillRouteBound (and each replica answers requests while the node is
// down); the replicas on the lost node reconnect to the survivors (counted
// on the servers), and they and only they log losing NATS and getting it
// back; a placement made after the loss on any replica shows up on the
// other two and routes there as placement_hit; kvrelay_gateway_nats_connected
// is 1 on every replica before the loss and after the failover, and reads 0
// in between only on a replica that was on the lost node; the replicas
// count each other as load-sharing peers again. Alongside, a JetStream stream with replicas=3
// takes publishes before, during and after each loss, and a durable
// consumer receives every one of them: the cluster assumption that KV
// events over JetStream rest on.
//
// It logs, per round, the time from the node's kill to placements shared
// again between every pair of replicas, and when each cut replica logged
// its reconnection (BENCHMARKS.md).

const (
	drillReplicas   = 3
	drillRounds     = 3
	drillRouteBound = 10 * time.Second // a generous bound, far above any healthy answer
	drillWait       = 60 * time.Second // for every condition the drill waits on
	drillGatewayTag = "kvrelay-gateway@"
)

// reconnectedRE finds when a replica (slog's text format) logged that it
// reconnected to NATS.
var reconnectedRE = regexp.MustCompile(`time=(\S+) level=INFO msg="nats reconnected`)

var placementsRE = regexp.MustCompile(`(?m)^kvrelay_gateway_placements\{model="([^"]+)"\} (\S+)$`)

// drillReplica is one `kvrelay gateway` run in-process.
type drillReplica struct {
	name   string // a, b, c; its probe model is "probe-"+name
	url    string // http://ADDR
	exit   chan int
	stderr *logbuf.Buffer
}

func (r *drillReplica) probeModel() string { return "probe-" + r.name }

// metrics fetches r's /metrics; an error is returned, not fatal, so
// goroutines can call it.
func (r *drillReplica) metrics(c *http.Client) (string, error) {
	resp, err := c.Get(r.url + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// metricValue reads one unlabelled sample ("" name → not found).
func metricValue(text, name string) (float64, bool) {
	for line := range strings.Lines(text) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			return f, err == nil
		}
	}
	return 0, false
}

// placementEntries is r's kvrelay_gateway_placements for model.
func placementEntries(text, model string) int {
	for _, m := range placementsRE.FindAllStringSubmatch(text, -1) {
		if m[1] == model {
			f, _ := strconv.ParseFloat(m[2], 64)
			return int(f)
		}
	}
	return 0
}

type routeAnswer struct {
	Status  int           `json:"-"`
	Worker  string        `json:"worker"`
	Reason  string        `json:"reason"`
	Elapsed time.Duration `json:"-"`
}

func routeOnce(c *http.Client, url, model string, toks []uint32) (routeAnswer, error) {
	start := time.Now()
	resp, err := c.Post(url+"/v1/route", "application/json",
		strings.NewReader(`{"model":"`+model+`","token_ids":`+apiclient.TokensJSON(toks)+`}`))
	if err != nil {
		return routeAnswer{Elapsed: time.Since(start)}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	a := routeAnswer{Status: resp.StatusCode, Elapsed: time.Since(start)}
	if err != nil {
		return a, err
	}
	if a.Status != http.StatusOK {
		return a, fmt.Errorf("status %d: %s", a.Status, body)
	}
	if err := json.Unmarshal(body, &a); err != nil {
		return a, err
	}
	return a, nil
}

// drillStream routes a steady stream of requests with shared prefixes
// through every replica and keeps what went wrong.
type drillStream struct {
	done    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
	mu      sync.Mutex
	fails   []string
	slowest time.Duration
	served  []atomic.Int64 // per replica
}

func startDrillStream(replicas []*drillReplica) *drillStream {
	s := &drillStream{done: make(chan struct{}), served: make([]atomic.Int64, len(replicas))}
	client := &http.Client{Timeout: drillRouteBound}
	for i, r := range replicas {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			for n := 0; ; n++ {
				select {
				case <-s.done:
					return
				case <-tick.C:
				}
				// Eight shared 128-token system prompts, each request its
				// own 32-token tail.
				toks := append(kvstream.SeqTokens(1_000*(n%8), 128), kvstream.SeqTokens(10_000_000+100_000*i+32*n, 32)...)
				a, err := routeOnce(client, r.url, "chat", toks)
				s.mu.Lock()
				s.slowest = max(s.slowest, a.Elapsed)
				if err != nil && len(s.fails) < 20 {
					s.fails = append(s.fails, fmt.Sprintf("replica %s request %d after %v: %v", r.name, n, a.Elapsed.Round(time.Millisecond), err))
				}
				s.mu.Unlock()
				if err == nil {
					s.served[i].Add(1)
				}
			}
		}()
	}
	return s
}

func (s *drillStream) stop() {
	s.once.Do(func() { close(s.done) })
	s.wg.Wait()
}

func (s *drillStream) failures() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.fails)
}

// connSampler reads every replica's kvrelay_gateway_nats_connected over
// and over, and remembers which replicas read 0 since the last reset.
type connSampler struct {
	done    chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
	mu      sync.Mutex
	zero    map[string]bool
	samples int
	errs    []string
}

func startConnSampler(replicas []*drillReplica) *connSampler {
	s := &connSampler{done: make(chan struct{}), zero: map[string]bool{}}
	client := &http.Client{Timeout: drillRouteBound}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		// Each scrape costs the replica tens of ms of CPU under -race: a
		// faster pace would load the machine more than the drill does.
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-tick.C:
			}
			for _, r := range replicas {
				text, err := r.metrics(client)
				v, ok := metricValue(text, "kvrelay_gateway_nats_connected")
				s.mu.Lock()
				switch {
				case err != nil || !ok:
					if len(s.errs) < 10 {
						s.errs = append(s.errs, fmt.Sprintf("replica %s: /metrics: %v (gauge found %v)", r.name, err, ok))
					}
				case v == 0:
					s.zero[r.name] = true
				case v != 1:
					s.errs = append(s.errs, fmt.Sprintf("replica %s: kvrelay_gateway_nats_connected %v", r.name, v))
				}
				s.samples++
				s.mu.Unlock()
			}
		}
	}()
	return s
}

// readZero returns which replicas read 0 since the last call, and forgets.
func (s *connSampler) readZero() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for name := range s.zero {
		out = append(out, name)
	}
	clear(s.zero)
	slices.Sort(out)
	return out
}

func (s *connSampler) stop() []string {
	s.once.Do(func() { close(s.done) })
	s.wg.Wait()
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.errs
}

// drillJetStream publishes numbered messages to a replicas=3 stream and
// consumes them with a durable consumer, both across the node losses.
type drillJetStream struct {
	nc    *nats.Conn
	js    jetstream.JetStream
	done  chan struct{}
	wg    sync.WaitGroup
	acked atomic.Int64 // messages 0..acked-1 are acknowledged by the stream

	mu          sync.Mutex
	got         map[int]int // message → deliveries
	slowestAck  time.Duration
	pubRetries  int
	consumeErrs int
	iter        jetstream.MessagesContext
}

func startDrillJetStream(t *testing.T, urls string) *drillJetStream {
	t.Helper()
	nc, err := nats.Connect(urls, nats.Name("drill-jetstream"), nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond),
		// Not nats.go's default, which writes to the process's stderr.
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { t.Logf("drill JetStream client: %v", err) }))
	if err != nil {
		t.Fatal(err)
	}
	d := &drillJetStream{nc: nc, done: make(chan struct{}), got: map[int]int{}}
	if d.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), drillWait)
	defer cancel()
	stream, err := d.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: "DRILL", Subjects: []string{"drill.>"}, Replicas: 3, Storage: jetstream.FileStorage,
	})
	if err != nil {
		t.Fatalf("create the R3 stream: %v", err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Config.Replicas != 3 || len(info.Cluster.Replicas) != 2 {
		t.Fatalf("stream is not R3: %d replicas configured, leader %q and %d others", info.Config.Replicas, info.Cluster.Leader, len(info.Cluster.Replicas))
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "drill", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	if d.iter, err = cons.Messages(); err != nil {
		t.Fatal(err)
	}
	d.wg.Add(2)
	go d.publish()
	go d.consume()
	return d
}

// publish sends message n until the stream acknowledges it (the same
// message id each try, so a retry of one that did land is not stored
// twice), then n+1.
func (d *drillJetStream) publish() {
	defer d.wg.Done()
	for n := 0; ; n++ {
		start := time.Now()
		for {
			select {
			case <-d.done:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_, err := d.js.Publish(ctx, "drill.events", []byte(strconv.Itoa(n)), jetstream.WithMsgID("m"+strconv.Itoa(n)))
			cancel()
			if err == nil {
				break
			}
			d.mu.Lock()
			d.pubRetries++
			d.mu.Unlock()
			time.Sleep(20 * time.Millisecond) // a retry's pace while the stream elects a leader
		}
		d.mu.Lock()
		d.slowestAck = max(d.slowestAck, time.Since(start))
		d.mu.Unlock()
		d.acked.Store(int64(n + 1))
		select {
		case <-d.done:
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (d *drillJetStream) consume() {
	defer d.wg.Done()
	for {
		msg, err := d.iter.Next()
		if errors.Is(err, jetstream.ErrMsgIteratorClosed) {
			return
		}
		if err != nil {
			d.mu.Lock()
			d.consumeErrs++
			d.mu.Unlock()
			continue
		}
		n, err := strconv.Atoi(string(msg.Data()))
		d.mu.Lock()
		if err == nil {
			d.got[n]++
		}
		d.mu.Unlock()
		_ = msg.Ack() // a lost ack is a redelivery, counted above
	}
}

// missing lists the acknowledged messages not consumed yet.
func (d *drillJetStream) missing() []int {
	acked := int(d.acked.Load())
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []int
	for n := range acked {
		if d.got[n] == 0 {
			out = append(out, n)
		}
	}
	return out
}

func (d *drillJetStream) stop() {
	close(d.done)
	d.iter.Stop()
	d.wg.Wait()
	d.nc.Close()
}

func drillEventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(drillWait)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", drillWait, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestNATSClusterDrill(t *testing.T) {
	if os.Getenv("KVRELAY_NATS_DRILL") == "" {
		t.Skip("the JetStream cluster failover drill (make test-long); set KVRELAY_NATS_DRILL=1 to run it")
	}
	verifyNoLeaks(t)
	cluster := testnats.StartCluster(t, 3)

	// The chat model takes the steady stream; each replica's probe model
	// is routed on that replica only, so another replica's placement count
	// for it moves only when that replica's placements arrive.
	names := []string{"a", "b", "c"}
	var workers []string
	for _, model := range append([]string{"chat"}, "probe-a", "probe-b", "probe-c") {
		for range 3 {
			workers = append(workers, "--worker", "grpc://"+kvstream.Start(t).Addr+",model="+model)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var replicas []*drillReplica
	for _, name := range names {
		r := &drillReplica{name: name, exit: make(chan int, 1), stderr: &logbuf.Buffer{}}
		args := append([]string{"gateway", "--listen", "127.0.0.1:0", "--nats", cluster.URLs(), "--placement-ttl", "1h"}, workers...)
		go func() { r.exit <- dispatch(ctx, args, nil, io.Discard, r.stderr) }()
		addrRE := regexp.MustCompile(`gateway listening\"? addr=(\S+)`)
		drillEventually(t, "replica "+name+" listening", func() bool {
			m := addrRE.FindStringSubmatch(r.stderr.String())
			if m != nil {
				r.url = "http://" + m[1]
			}
			return m != nil
		})
		replicas = append(replicas, r)
	}
	defer func() {
		cancel()
		for _, r := range replicas {
			select {
			case code := <-r.exit:
				if code != 0 {
					t.Errorf("replica %s exit %d: %s", r.name, code, r.stderr.String())
				}
			case <-time.After(drillWait):
				t.Errorf("replica %s did not stop", r.name)
			}
		}
	}()
	client := &http.Client{Timeout: drillRouteBound}
	metricsOf := func(r *drillReplica) string {
		text, err := r.metrics(client)
		if err != nil {
			t.Fatalf("replica %s /metrics: %v", r.name, err)
		}
		return text
	}
	gaugeOn := func(r *drillReplica, name string) float64 {
		v, ok := metricValue(metricsOf(r), name)
		if !ok {
			t.Fatalf("replica %s has no %s", r.name, name)
		}
		return v
	}
	gatewaysConnected := func() int {
		n := 0
		for _, node := range cluster.Nodes {
			n += node.ClientsNamed(drillGatewayTag)
		}
		return n
	}
	allShareLoad := func() bool {
		for _, r := range replicas {
			if gaugeOn(r, "kvrelay_gateway_nats_connected") != 1 || gaugeOn(r, "kvrelay_gateway_nats_peers") != drillReplicas-1 {
				return false
			}
		}
		return true
	}
	drillEventually(t, "every replica connected to the cluster and counting the other two as peers", func() bool {
		return gatewaysConnected() == drillReplicas && allShareLoad()
	})

	var probes atomic.Int64
	freshProbe := func() []uint32 { return kvstream.SeqTokens(int(probes.Add(1))*1_000_000, 256) } // 16 blocks
	// offerProbe routes a fresh probe on from and waits up to wait for it to
	// arrive on every other replica (its placement count there rising by its
	// 16 blocks). hold, unless nil, runs between reading the counts and
	// routing. It returns the prompt, when it was routed, the worker, and
	// whether it arrived; errors are returned, not fatal, for the probers'
	// goroutines.
	offerProbe := func(from *drillReplica, wait time.Duration, hold func(), before map[string]int) (p []uint32, routed time.Time, worker string, arrived bool, seen map[string]int, err error) {
		model := from.probeModel()
		entries := func(r *drillReplica) (int, error) {
			text, err := r.metrics(client)
			return placementEntries(text, model), err
		}
		if before == nil {
			before = map[string]int{}
			for _, r := range replicas {
				if r != from {
					if before[r.name], err = entries(r); err != nil {
						return nil, routed, "", false, nil, err
					}
				}
			}
		}
		if hold != nil {
			hold()
		}
		p = freshProbe()
		routed = time.Now()
		a, err := routeOnce(client, from.url, model, p)
		if err != nil {
			return nil, routed, "", false, nil, fmt.Errorf("probe on replica %s: %w", from.name, err)
		}
		// At least three reads after routing: a read of /metrics can take
		// longer than the whole wait on a loaded machine, and a placement
		// seen late is not a lost one.
		deadline := time.Now().Add(wait)
		seen = map[string]int{}
		for polls := 1; ; polls++ {
			arrived = true
			for _, r := range replicas {
				if r == from {
					continue
				}
				if seen[r.name], err = entries(r); err != nil {
					return nil, routed, "", false, nil, err
				}
				arrived = arrived && seen[r.name] >= before[r.name]+16
			}
			if arrived || (polls >= 3 && time.Now().After(deadline)) {
				return p, routed, a.Worker, arrived, seen, nil
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// checkShared: a placement made on each replica is where the other two
	// route its prefix (placement_hit, the same worker).
	checkShared := func(when string) {
		t.Helper()
		for _, from := range replicas {
			p, _, worker, ok, _, err := offerProbe(from, drillWait, nil, nil)
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
			if !ok {
				t.Fatalf("%s: replica %s's placement never reached the others", when, from.name)
			}
			for _, r := range replicas {
				if r == from {
					continue
				}
				a, err := routeOnce(client, r.url, from.probeModel(), append(p, 7, 7, 7))
				if err != nil {
					t.Fatalf("%s: replica %s: %v", when, r.name, err)
				}
				if a.Worker != worker || a.Reason != "placement_hit" {
					t.Fatalf("%s: replica %s routes %s's prefix to %s (%s), want %s (placement_hit)", when, r.name, from.name, a.Worker, a.Reason, worker)
				}
			}
		}
	}
	checkShared("before any loss")

	stream := startDrillStream(replicas)
	defer stream.stop()
	sampler := startConnSampler(replicas)
	defer sampler.stop()
	jsd := startDrillJetStream(t, cluster.URLs())
	defer jsd.stop()
	drillEventually(t, "the R3 stream takes publishes", func() bool { return jsd.acked.Load() >= 20 })

	var sharedAgain []time.Duration
	for round := range drillRounds {
		// Quiet before the loss: every replica says it is connected.
		sampler.readZero()
		for _, r := range replicas {
			if v := gaugeOn(r, "kvrelay_gateway_nats_connected"); v != 1 {
				t.Fatalf("round %d: replica %s reads nats_connected %v before the loss", round, r.name, v)
			}
		}
		victim := cluster.MetaLeader()
		if round > 0 {
			for _, n := range cluster.Nodes {
				if n.ClientsNamed(drillGatewayTag) > victim.ClientsNamed(drillGatewayTag) {
					victim = n
				}
			}
		}
		onVictim := victim.ClientsNamed(drillGatewayTag)
		wasLeader := victim == cluster.MetaLeader()
		servedBefore := make([]int64, len(replicas))
		for i := range replicas {
			servedBefore[i] = stream.served[i].Load()
		}
		ackedBefore := jsd.acked.Load()

		logsBefore := make([]string, len(replicas))
		for i, r := range replicas {
			logsBefore[i] = r.stderr.String()
		}

		// Placements shared again: for each replica, the first placement
		// made after the loss that reached the other two. Every replica
		// probes at once, each try a fresh placement (one made while its
		// replica is cut off is dropped, never sent late), so each replica's
		// time is within one try of when its sharing resumed. The first try
		// reads the counts before the kill and routes right after it.
		var killed time.Time
		start := make(chan struct{})
		var scraped, probers sync.WaitGroup
		firstShared := make([]time.Duration, len(replicas))
		tries := make([]int, len(replicas))
		lastMiss := make([]time.Duration, len(replicas)) // the last try that did not reach both others
		probeErrs := make([]error, len(replicas))
		for i, r := range replicas {
			scraped.Add(1)
			probers.Add(1)
			go func() {
				defer probers.Done()
				held := false
				hold := func() { held = true; scraped.Done(); <-start }
				var before map[string]int
				for tries[i] = 1; ; tries[i]++ {
					// A retry starts from the counts its failed try last
					// read, so a placement of that try arriving late counts
					// for this one: the time is then an upper bound, and a
					// retry costs one route and the reads that follow.
					wait := 300 * time.Millisecond
					if tries[i] == 1 {
						wait = time.Second
					}
					_, routed, _, ok, seen, err := offerProbe(r, wait, hold, before)
					if !held {
						held = true
						scraped.Done() // failed before it held: the kill must not wait for it
					}
					hold, before = nil, seen
					if !ok && err == nil {
						lastMiss[i] = routed.Sub(killed)
					}
					switch {
					case err != nil:
						probeErrs[i] = err
						return
					case ok:
						firstShared[i] = routed.Sub(killed)
						return
					case time.Since(killed) > drillWait:
						probeErrs[i] = fmt.Errorf("replica %s's placements not shared again %v after losing %s", r.name, drillWait, victim.Name())
						return
					}
				}
			}()
		}
		scraped.Wait()
		killed = time.Now()
		victim.Stop()
		close(start)
		probers.Wait()
		if err := errors.Join(probeErrs...); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		took := slices.Max(firstShared)
		sharedAgain = append(sharedAgain, took)

		drillEventually(t, "the replicas reconnected to the surviving nodes", func() bool {
			return gatewaysConnected() == drillReplicas && victim.ClientsNamed(drillGatewayTag) == 0
		})
		drillEventually(t, "every replica sharing load with the other two again", allShareLoad)
		checkShared(fmt.Sprintf("round %d, %s down", round, victim.Name()))
		// The R3 stream takes publishes with one node of three down.
		drillEventually(t, "the R3 stream taking publishes with a node down", func() bool { return jsd.acked.Load() >= ackedBefore+50 })
		for i, r := range replicas {
			if stream.served[i].Load() <= servedBefore[i] {
				t.Fatalf("round %d: replica %s answered no request while %s was down", round, r.name, victim.Name())
			}
		}
		// The replicas on the lost node, and only they, say they lost NATS
		// and got it back; only they may have read nats_connected 0.
		var cut []string
		var reconnected []time.Duration // by the replicas' own log times
		for i, r := range replicas {
			logs := strings.TrimPrefix(r.stderr.String(), logsBefore[i])
			lost := strings.Contains(logs, "nats disconnected")
			back := reconnectedRE.FindStringSubmatch(logs)
			if lost != (back != nil) {
				t.Errorf("round %d: replica %s logged disconnected %v, reconnected %v", round, r.name, lost, back != nil)
			}
			if lost {
				cut = append(cut, r.name)
			}
			if back != nil {
				at, err := time.Parse(time.RFC3339Nano, back[1])
				if err != nil {
					t.Fatalf("log time %q: %v", back[1], err)
				}
				reconnected = append(reconnected, at.Sub(killed))
			}
		}
		if len(cut) != onVictim {
			t.Errorf("round %d: replicas %v logged losing NATS, but %d were on %s", round, cut, onVictim, victim.Name())
		}
		zero := sampler.readZero()
		for _, name := range zero {
			if !slices.Contains(cut, name) {
				t.Errorf("round %d: replica %s read nats_connected 0 but never lost its node", round, name)
			}
		}
		t.Logf("round %d: lost %s (meta leader %v, replicas %v on it, reconnected after %v); placements shared again after %v (per replica %v, tries %v, last missed try routed at %v); read nats_connected 0: %v",
			round, victim.Name(), wasLeader, cut, reconnected, took.Round(time.Millisecond), firstShared, tries, lastMiss, zero)

		victim.Restart()
		cluster.Ready()
		drillEventually(t, "the restarted node in the R3 stream's group again", func() bool {
			srv := victim.Server()
			return srv != nil && srv.JetStreamIsStreamCurrent("$G", "DRILL") // $G: the default account
		})
	}

	stream.stop()
	if fails := stream.failures(); len(fails) > 0 {
		t.Errorf("%d routing failures, first: %s", len(fails), strings.Join(fails, "; "))
	}
	if errs := sampler.stop(); len(errs) > 0 {
		t.Errorf("nats_connected samples: %s", strings.Join(errs, "; "))
	}
	// Every acknowledged message reaches the durable consumer.
	final := jsd.acked.Load()
	drillEventually(t, "the consumer to receive every acknowledged message", func() bool {
		return len(jsd.missing()) == 0 && jsd.acked.Load() >= final
	})
	jsd.mu.Lock()
	redelivered := 0
	for _, c := range jsd.got {
		redelivered += c - 1
	}
	t.Logf("R3 stream: %d messages acknowledged and consumed across %d losses; %d publish retries, slowest acknowledgement %v; %d redeliveries; %d consumer errors",
		final, drillRounds, jsd.pubRetries, jsd.slowestAck.Round(time.Millisecond), redelivered, jsd.consumeErrs)
	jsd.mu.Unlock()
	var total int64
	for i := range replicas {
		total += stream.served[i].Load()
	}
	stream.mu.Lock()
	slowest := stream.slowest
	stream.mu.Unlock()
	sorted := slices.Clone(sharedAgain)
	slices.Sort(sorted)
	t.Logf("routing: %d requests answered, slowest %v, none failed; placements shared again after a node loss: %v (median %v, max %v)",
		total, slowest.Round(time.Millisecond), sharedAgain, sorted[len(sorted)/2].Round(time.Millisecond), sorted[len(sorted)-1].Round(time.Millisecond))
}
