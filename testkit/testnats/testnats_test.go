package testnats

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func connect(t *testing.T, urls string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(urls, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestSingleNodeRestartsOnItsPortAndStore: a stopped node comes back on
// the client port it had, its JetStream store kept, and a client given its
// URL reconnects by itself.
func TestSingleNodeRestartsOnItsPortAndStore(t *testing.T) {
	n := Start(t, Config{})
	url := n.URL()
	nc := connect(t, url)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.1", []byte("kept")); err != nil {
		t.Fatal(err)
	}

	n.Stop()
	if n.Running() || n.Server() != nil {
		t.Fatal("running after Stop")
	}
	eventually(t, "client sees the loss", func() bool { return !nc.IsConnected() })
	n.Stop() // a second Stop does nothing

	n.Restart()
	if n.URL() != url {
		t.Fatalf("restarted on %s, was %s", n.URL(), url)
	}
	eventually(t, "client reconnects", nc.IsConnected)
	stream, err := js.Stream(ctx, "S")
	if err != nil {
		t.Fatalf("stream lost across the restart: %v", err)
	}
	msg, err := stream.GetLastMsgForSubject(ctx, "s.1")
	if err != nil {
		t.Fatalf("stream lost across the restart: %v", err)
	}
	if string(msg.Data) != "kept" {
		t.Fatalf("message %q", msg.Data)
	}
}

// TestSingleNodeOnAGivenPortWithoutJetStream: a fixed port is used as
// given, and NoJetStream leaves JetStream off.
func TestSingleNodeOnAGivenPortWithoutJetStream(t *testing.T) {
	n := Start(t, Config{NoJetStream: true})
	port := strings.TrimPrefix(n.URL(), "nats://127.0.0.1:")
	n.Stop()
	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	again := Start(t, Config{Port: p, NoJetStream: true})
	if again.URL() != n.URL() {
		t.Fatalf("asked for port %d, got %s", p, again.URL())
	}
	if again.Server().JetStreamEnabled() {
		t.Error("JetStream on with NoJetStream")
	}
}

// TestClusterLosesAndRegainsANode: three nodes form a cluster with one
// meta leader; with the leader stopped the other two elect a new one, and
// the stopped node rejoins on restart.
func TestClusterLosesAndRegainsANode(t *testing.T) {
	c := StartCluster(t, 3)
	if got := strings.Count(c.URLs(), ","); got != 2 {
		t.Fatalf("URLs %q: want three", c.URLs())
	}
	for _, n := range c.Nodes {
		srv := n.Server()
		if srv.ClusterName() != c.Name || srv.NumRemotes() != 2 || !srv.JetStreamIsClustered() {
			t.Fatalf("%s: cluster %q, %d remotes, clustered %v", n.Name(), srv.ClusterName(), srv.NumRemotes(), srv.JetStreamIsClustered())
		}
	}
	old := c.MetaLeader()
	if old == nil {
		t.Fatal("ready without a meta leader")
	}
	nc := connect(t, c.URLs())
	old.Stop()
	c.Ready()
	if l := c.MetaLeader(); l == nil || l == old {
		t.Fatalf("meta leader after losing %s: %v", old.Name(), l)
	}
	for _, n := range c.Nodes {
		if srv := n.Server(); srv != nil && srv.NumRemotes() != 1 {
			t.Fatalf("%s has %d remotes with one node down", n.Name(), srv.NumRemotes())
		}
	}
	eventually(t, "client on a surviving node", func() bool {
		return nc.IsConnected() && nc.ConnectedUrl() != old.URL()
	})

	old.Restart()
	c.Ready()
	for _, n := range c.Nodes {
		if n.Server().NumRemotes() != 2 {
			t.Fatalf("%s: %d remotes after the restart", n.Name(), n.Server().NumRemotes())
		}
	}
	nc.Close()
	// Two of three down leaves no quorum: Ready says so instead of hanging.
	c.Nodes[0].Stop()
	c.Nodes[1].Stop()
	if p := c.notReady(); !strings.Contains(p, "no quorum") {
		t.Errorf("1 of 3 running: %q", p)
	}
}

// TestClientsNamed counts a node's clients by connection name.
func TestClientsNamed(t *testing.T) {
	n := Start(t, Config{NoJetStream: true})
	for _, name := range []string{"gw-a", "gw-b", "other"} {
		nc, err := nats.Connect(n.URL(), nats.Name(name))
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
	}
	if got := n.ClientsNamed("gw-"); got != 2 {
		t.Errorf("ClientsNamed(gw-) = %d, want 2", got)
	}
	n.Stop()
	if got := n.ClientsNamed("gw-"); got != 0 {
		t.Errorf("stopped node counts %d clients", got)
	}
}
