package freeport

import (
	"fmt"
	"net"
	"testing"
)

func TestRangeIsBindable(t *testing.T) {
	base, err := Range(3)
	if err != nil {
		t.Fatal(err)
	}
	for p := base; p < base+3; p++ {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			t.Fatalf("port %d of the range is not free: %v", p, err)
		}
		l.Close()
	}
}

func TestRangeRejectsNothing(t *testing.T) {
	if _, err := Range(0); err == nil {
		t.Fatal("Range(0) must be an error")
	}
}
